"""SFT bootstrap: train the base model from scratch on a noisy teacher's worked solutions.

The teacher makes systematic mistakes (dropped carries, slipped countdown steps), so the
base model is good but imperfect and RL has something real to fix. The result is
published as version 0 of the run's `base/` parameter server, from which the trainer
starts when it has no checkpoint of its own.

With `sft.judge_fraction` > 0 (for learning to judge), that fraction of the demonstrations
go on with the verification suffix and a verdict, `[BOS] prompt | solution | ;ok? | v [EOS]`,
v a fair coin, the verifier's grade of the solution, or the verifier's grade of a solution
drawn correct or wrong by a fair coin (`sft.judge_labels`, `JUDGE_LABELS`), so the base
model writes verdicts where RL's judge groups ask for one. Those decisions use their own
random stream: with judge_fraction = 0 the batches are exactly those of before.

    python -m tpu_jobs.sft --run RUN_URL
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipeline.run import BASE_PREFIX, Run, base_server
from pipeline.tasks import TASKS
from pipeline.tasks.base import SyntheticTask
from pipeline.tasks.judge import verdict_text
from pipeline.tasks.mix import synthetic_task
from pipeline.tokenizer.run import run_tokenizer
from tpu_jobs.model.batching import pack_rows, round_up
from tpu_jobs.model.judge import judged_completion_len, suffix_ids
from tpu_jobs.model.state import make_optimizer, new_model, params_to_flat

BALANCED_TRIES = 16  # teacher draws per demonstration to find a wrong solution


def label_by_coin(task, problem, text, coin, rng, options) -> tuple[str, str]:
    """sft.judge_labels="random": the demonstration as drawn, a fair-coin verdict."""
    return text, verdict_text(coin)


def label_by_verifier(task, problem, text, coin, rng, options) -> tuple[str, str]:
    """sft.judge_labels="verifier": the demonstration as drawn, the verifier's verdict."""
    return text, verdict_text(task.verify(problem, text) >= 1.0)


def label_balanced(task, problem, text, coin, rng, options) -> tuple[str, str]:
    """sft.judge_labels="balanced": the coin picks a correct solution (the teacher without
    its mistakes) or a wrong one (noisy teacher draws until one is wrong, at most
    BALANCED_TRIES; a problem where the teacher cannot err keeps a correct one), and the
    verifier labels it, so the verdict is independent of the problem's difficulty."""
    teacher = task.noiseless(options) if coin else options
    for _ in range(1 if coin else BALANCED_TRIES):
        text = task.teacher_solution(problem, rng, teacher)
        correct = task.verify(problem, text) >= 1.0
        if correct == coin:
            break
    return text, verdict_text(correct)


def label_slips(task, problem, text, coin, rng, options) -> tuple[str, str]:
    """sft.judge_labels="slips": as "balanced", but half the wrong solutions are the
    family's slips (`SyntheticTask.slipped_solution`: a wrong digit or carry carried
    through, a miscopied answer) instead of the teacher's own mistakes, so the judge
    learns the errors a policy sampling at temperature 1 makes, not only the teacher's
    (a judge SFT'd on dropped carries alone ranked an RL'd policy's samples at a
    within-problem AUC of 0.71, against 0.94 on its own base's). A family without slips,
    or a slip the verifier still grades correct, falls back to "balanced".
    Measured on demo.yaml, seed 0 (benchmarks/results/selfprm.md, variant `slips`): it did
    not pay. The base judged its own samples worse (AUC 0.83 against 0.94), and the v40
    samples no better (0.66 against 0.71); the slipped chains, trained as targets, cost
    pass@1 (0.390 against 0.481)."""
    if not coin and rng.random() < 0.5:
        slipped = task.slipped_solution(problem, rng, options)
        if slipped is not None and task.verify(problem, slipped) < 1.0:
            return slipped, verdict_text(False)
    return label_balanced(task, problem, text, coin, rng, options)


# sft.judge_labels -> (task, problem, drawn text, coin, rng, family options) -> (text, verdict)
JUDGE_LABELS = {
    "random": label_by_coin,
    "verifier": label_by_verifier,
    "balanced": label_balanced,
    "slips": label_slips,
}


def has_teacher(problem) -> bool:
    """Whether the problem's family can demonstrate it (generated, not curated, problems)."""
    task = TASKS[problem.task]
    return isinstance(task, SyntheticTask) and task.has_teacher(problem)


def teacher_batch(run: Run, problems, step: int, tok, prompt_len: int, completion_len: int):
    cfg = run.config
    rng = np.random.default_rng([cfg.seed, step, 0x5F7])
    idx = rng.integers(0, len(problems), cfg.sft.batch_size)
    judge_fraction = cfg.sft.judge_fraction
    if judge_fraction > 0:  # own stream: the teacher's draws stay those of a plain SFT
        jrng = np.random.default_rng([cfg.seed, step, 0x7D6E])
        judged = jrng.random(len(idx)) < judge_fraction
        coins = jrng.random(len(idx)) < 0.5
    prompts, completions, sampled = [], [], []
    for row, i in enumerate(idx):
        p = problems[i]
        task = synthetic_task(p.task)
        options = cfg.task.options_for(p.task)
        pieces = task.teacher_pieces(p, rng, options)
        text = "".join(piece for piece, _ in pieces)
        prompts.append(tok.encode_prompt(p.prompt))
        if judge_fraction > 0 and judged[row]:
            label = JUDGE_LABELS[cfg.sft.judge_labels]
            text, verdict = label(task, p, text, bool(coins[row]), jrng, options)
            completions.append(
                [*tok.encode_completion(text), *suffix_ids(tok), *tok.encode_completion(verdict)]
            )
            # Every token a target, the judged solution too (wrong half the time under
            # "balanced"): with only the verdict as a target the base judge ranked its own
            # samples at a within-problem AUC of 0.70 against 0.94, and solving gained
            # nothing (pass@1 0.474 against 0.481; selfprm.md, era 3).
            sampled.append([1] * len(completions[-1]))
        else:
            ids, mask = piece_ids(tok, pieces)
            completions.append([*ids, tok.eos_id])
            sampled.append([*mask, 1])
    # Pad completions only to the batch's longest, in buckets of 16: fewer wasted
    # positions, and at most completion_len / 16 compiled shapes.
    width = min(completion_len, round_up(max(len(c) for c in completions), 16))
    return pack_rows(prompts, completions, prompt_len, width, tok.pad_id, loss_masks=sampled)


def piece_ids(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids of a teacher's pieces, each encoded on its own as a tool episode's turns
    and observations are (`tpu_jobs.generate.episodes`), and the loss mask: 1 on the pieces the
    policy writes, 0 on the others (a tool's observation: context, not a target)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, is_sampled in pieces:
        piece = tok.encode(text)
        ids += piece
        mask += [int(is_sampled)] * len(piece)
    return ids, mask


def sft_loss(fns, params, tokens, mask, comp_mask, prompt_len: int) -> jax.Array:
    """Mean negative log-likelihood of the trained completion tokens (a pure function).

    tokens, mask [B, P + C] (`pack_rows`: `mask` is the attention mask, every real token);
    comp_mask [B, C] is 1 on the completion tokens to learn and 0 elsewhere. A teacher
    transcript with a tool's observations passes them with 0 in comp_mask (`pack_rows`'
    `loss_masks`): they stay in the sequence as context, attended to at their positions,
    but are not targets and do not count in the mean (tests/tpu_jobs/test_loss_mask.py).
    `fns` is the model's functional form (`tpu_jobs.model.state.split_model`).
    """
    logp = fns.logprobs(params, tokens, mask, first=prompt_len)  # completion positions
    return -(logp * comp_mask).sum() / jnp.maximum(comp_mask.sum(), 1.0)


def sft_step(fns, tx: optax.GradientTransformation, prompt_len: int):
    """The jitted SFT update (params, opt_state, tokens, mask, comp_mask) -> (params,
    opt_state, loss) of `sft_loss` under the optimizer `tx`."""

    @jax.jit
    def step_fn(params, opt_state, tokens, mask, comp_mask):
        loss, grads = jax.value_and_grad(
            lambda prm: sft_loss(fns, prm, tokens, mask, comp_mask, prompt_len)
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step_fn


def train_sft(run: Run) -> dict[str, float]:
    """Train the base model and publish it as version 0 of `base/`.

    Runs `sft.steps` steps, or with `sft.target_loss` > 0 stops early at the first check
    (every `sft.check_every` steps) where the mean loss since the last check is at most
    the target; the steps used and whether the target was reached go into the metrics
    and the snapshot's metadata."""
    cfg = run.config
    sc = cfg.sft
    server = base_server(run)
    if 0 in server.versions():
        print(f"[sft] base model already published at {run.url}/{BASE_PREFIX}; skipping")
        return {}
    tok = run_tokenizer(run)
    problems = run.read_problems("train")
    no_teacher = sorted({p.task for p in problems if not has_teacher(p)})
    if no_teacher:
        raise ValueError(
            f"the SFT bootstrap needs a teacher, and problems of task families {no_teacher} "
            f"in run {run.url} come from a dataset with no teacher: start from a pretrained "
            "model instead (`rlax import-hf`, or the DAG's hf_checkpoint param)"
        )
    prompt_len = round_up(max(len(tok.encode_prompt(p.prompt)) for p in problems), 8)
    completion_len = cfg.completion_tokens()  # a turn, or a whole tool episode
    if sc.judge_fraction > 0:  # room for the suffix and the verdict
        completion_len = judged_completion_len(completion_len, tok)

    fns, params = new_model(cfg.model, cfg.seed)
    tx = make_optimizer(sc.lr, sc.warmup_steps, sc.steps, sc.weight_decay, 1.0)
    opt_state = tx.init(params)

    step_fn = sft_step(fns, tx, prompt_len)
    t0 = time.time()
    tokens_seen = 0
    loss = float("nan")
    window: list[jax.Array] = []  # this check's step losses, read once per check
    reached = False
    step = 0
    for step in range(1, sc.steps + 1):
        tokens, mask, comp_mask = teacher_batch(
            run, problems, step - 1, tok, prompt_len, completion_len
        )
        params, opt_state, loss_arr = step_fn(params, opt_state, tokens, mask, comp_mask)
        window.append(loss_arr)
        tokens_seen += int(mask.sum())
        if step % sc.check_every == 0 or step == sc.steps:
            loss = float(np.mean(jax.device_get(window)))
            window.clear()
            reached = sc.target_loss > 0 and loss <= sc.target_loss
            elapsed = time.time() - t0
            target = f" (target {sc.target_loss:g})" if sc.target_loss > 0 else ""
            print(
                f"[sft] step {step}/{sc.steps} loss {loss:.4f}{target} "
                f"{tokens_seen / elapsed:,.0f} tok/s {elapsed:.0f}s",
                flush=True,
            )
            run.log_metrics("sft", step, {"loss": loss, "elapsed_s": elapsed})
            if reached:
                print(f"[sft] reached the target loss at step {step}", flush=True)
                break
    if sc.target_loss > 0 and not reached:
        print(
            f"[sft] the target loss {sc.target_loss:g} was not reached in {sc.steps} steps "
            f"(last {loss:.4f}); publishing the model as it is",
            flush=True,
        )
    server.publish(
        0,
        params_to_flat(fns, params),
        epoch=server.acquire_epoch(),
        metadata={
            "source": "sft",
            "steps": step,
            "max_steps": sc.steps,
            "target_loss": sc.target_loss,
            "target_reached": reached,
            "final_loss": loss,
        },
    )
    print(f"[sft] published base model after {step} steps in {time.time() - t0:.0f}s", flush=True)
    return {"loss": loss, "steps": step, "seconds": time.time() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_jobs.sft", description=__doc__)
    parser.add_argument("--run", required=True, help="run URL (directory or gs://bucket/prefix)")
    args = parser.parse_args(argv)
    train_sft(Run.open(args.run))
    return 0


if __name__ == "__main__":
    from pipeline.entrypoint import run_main

    sys.exit(run_main("sft", main))
