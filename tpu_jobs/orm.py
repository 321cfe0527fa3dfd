"""ORM baseline: an outcome reward model (external verifier) trained on the run's rollouts.

    python -m tpu_jobs.orm --run RUN_URL        (or `rlax orm --run RUN_URL`)

A separate model of the same family as the policy judges a solution in the shared
self-verification format (`pipeline/tasks/judge.py`):

    [BOS] prompt | solution EOS | JUDGE_SUFFIX | verdict

and its score is p(y) / (p(y) + p(n)) at the verdict position, computed by the same
`tpu_jobs.model.judge.self_scores` as the policy's Self-PRM score, with the ORM's weights. So
Self-PRM and ORM differ only in whose weights read the sequence.

Model: `eval.orm_preset` ("" = the run's own model config). When its config equals the
run's model config and the run has an SFT base (`base/` version 0, `tpu_jobs/sft.py`),
the ORM starts from those base weights (it can already read the task); otherwise (a
different shape, or no base) it starts from a seeded random initialisation. Which one is
recorded as `init` in the snapshot metadata and the summary record.

Data: every solve row of the run's committed rollout batches (`rollouts/b*.parquet`;
learning-to-judge rows are skipped), labelled correct iff reward >= 1. Prompts (by
prompt id) are split at random (seeded) into training and a held-out `eval.orm_holdout`
fraction, so no held-out problem is seen in training.

Training: `eval.orm_steps` AdamW steps of `eval.orm_batch_size` rows drawn uniformly with
replacement; the loss is the cross-entropy of the verdict token only (full softmax),
class-balanced: a row of class c weighs N / (2 N_c), so both classes count equally. The
held-out accuracy (verdict = score > 0.5), balanced accuracy, AUC and verdict loss are
reported before and after training.

Output: the weights, published create-only as version 0 of the parameter server under
`orm/` (metadata: model config, init, data counts, validation metrics); the loss curve in
`metrics/orm_train/` and a summary in `metrics/orm/00000000.json`. A run whose `orm/`
version 0 exists is skipped (idempotent; delete `orm/` to retrain).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipeline.config import ModelConfig
from pipeline.metrics import roc_auc
from pipeline.rollouts import from_parquet_bytes
from pipeline.run import ORM_PREFIX, Run, RunError, base_server, orm_server
from pipeline.tokenizer.run import run_tokenizer
from tpu_jobs.model.batching import pack_rows, round_up
from tpu_jobs.model.judge import judge_sequences, self_scores, verdict_ids
from tpu_jobs.model.state import flat_to_params, make_optimizer, new_model, params_to_flat

ORM_SEED_STREAM = 0x0E4


def orm_model_config(run: Run) -> ModelConfig:
    """The ORM's model config: the run's own, or `eval.orm_preset` at the run's vocabulary,
    context length, dtype and logits chunk."""
    cfg = run.config
    if not cfg.eval.orm_preset:
        return cfg.model
    return ModelConfig(
        preset=cfg.eval.orm_preset,
        vocab_size=cfg.model.vocab_size,
        max_seq_len=cfg.model.max_seq_len,
        dtype=cfg.model.dtype,
        logits_chunk=cfg.model.logits_chunk,
    )


def labelled_rollouts(run: Run) -> dict[str, list]:
    """Solve rows of every committed rollout batch: prompt ids, completion ids, label
    (reward >= 1) and prompt id, in batch then row order."""
    out: dict[str, list] = {"prompt_ids": [], "solution_ids": [], "label": [], "prompt_id": []}
    for key in run.store.list("rollouts/"):
        if not key.endswith(".parquet"):
            continue
        batch = from_parquet_bytes(run.store.read(key))
        judge = batch.is_judge()
        for i in range(len(batch)):
            if judge[i]:
                continue
            out["prompt_ids"].append(list(batch.prompt_ids[i]))
            out["solution_ids"].append(list(batch.completion_ids[i]))
            out["label"].append(bool(batch.reward[i] >= 1.0))
            out["prompt_id"].append(batch.prompt_id[i])
    return out


def split_by_prompt(prompt_ids: list[str], holdout: float, seed: int) -> np.ndarray:
    """[rows] bool, True for held-out rows: a seeded random `holdout` fraction of the
    distinct prompts (at least one, and at least one left for training)."""
    distinct = sorted(set(prompt_ids))
    if len(distinct) < 2:
        raise RunError(
            f"the ORM needs rollouts of at least 2 distinct prompts to hold one out; found "
            f"{len(distinct)}. Run the trainer and rollout workers first (`rlax train`, "
            "`rlax rollout`)"
        )
    rng = np.random.default_rng([seed, ORM_SEED_STREAM])
    n_out = min(len(distinct) - 1, max(1, int(round(holdout * len(distinct)))))
    held = {distinct[i] for i in rng.permutation(len(distinct))[:n_out]}
    return np.asarray([p in held for p in prompt_ids], bool)


def pack_judged(tok, prompt_ids, solution_ids, labels):
    """(tokens, mask, verdict_pos, verdict_id) of judged rows ending in their true verdict."""
    yes, no = verdict_ids(tok)
    prompts, contexts = judge_sequences(tok, prompt_ids, solution_ids)
    targets = np.where(np.asarray(labels, bool), yes, no).astype(np.int32)
    completions = [[*c, int(t)] for c, t in zip(contexts, targets, strict=True)]
    prompt_len = round_up(max(len(p) for p in prompts), 8)
    width = round_up(max(len(c) for c in completions), 16)
    tokens, mask, _ = pack_rows(prompts, completions, prompt_len, width, tok.pad_id)
    pos = np.asarray([prompt_len + len(c) - 1 for c in completions], np.int32)
    return tokens, mask, pos, targets


def class_weights(labels: np.ndarray) -> np.ndarray:
    """Per-row weight N / (2 N_c): each class contributes half of the loss (a class that
    is absent leaves the other at weight 1)."""
    y = np.asarray(labels, bool)
    n, n_pos = y.size, int(y.sum())
    if n_pos in (0, n):
        return np.ones(n, np.float32)
    return np.where(y, n / (2.0 * n_pos), n / (2.0 * (n - n_pos))).astype(np.float32)


def judge_metrics(scores: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """Accuracy, balanced accuracy and AUC of scores (verdict = score > 0.5), and the
    class-balanced verdict loss -log of the two-way probability of the true verdict."""
    s = np.asarray(scores, np.float64)
    y = np.asarray(labels, bool)
    yes = s > 0.5
    recalls = [float((yes[y == c] == c).mean()) for c in (True, False) if (y == c).any()]
    p_true = np.clip(np.where(y, s, 1.0 - s), 1e-7, 1.0)
    w = class_weights(y)
    return {
        "accuracy": float((yes == y).mean()),
        "balanced_accuracy": float(np.mean(recalls)),
        "auc": roc_auc(s, y),
        "loss": float(-(w * np.log(p_true)).sum() / w.sum()),
        "rows": int(y.size),
        "positives": int(y.sum()),
    }


def verdict_step(fns, tx: optax.GradientTransformation):
    """A jitted optimiser step of the weighted verdict cross-entropy:
    (params, opt_state, tokens, mask, verdict_pos, row_weight) -> (params, opt_state, loss),
    the loss being -sum(w * log p(verdict)) / sum(w) at each row's verdict position."""

    def loss_fn(params, tokens, mask, pos, w):
        logp = fns.logprobs(params, tokens, mask)  # [B, T]: log p(token t | tokens < t)
        verdict = jnp.take_along_axis(logp, pos[:, None], axis=1)[:, 0]
        return -(w * verdict).sum() / jnp.maximum(w.sum(), 1e-6)

    @jax.jit
    def step(params, opt_state, tokens, mask, pos, w):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, mask, pos, w)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def train_orm(run: Run, *, log=print, log_every: int = 25) -> dict[str, Any]:
    """Train and publish the run's ORM (see the module doc); skip if it exists."""
    cfg, ec = run.config, run.config.eval
    server = orm_server(run)
    if 0 in server.versions():
        log(f"[orm] ORM already published at {run.url}/{ORM_PREFIX}; skipping")
        summary = run.read_metrics("orm")
        return summary[0] if summary else {}
    t0 = time.time()
    tok = run_tokenizer(run)
    data = labelled_rollouts(run)
    if not data["label"]:
        raise RunError(
            f"run {run.url} has no rollout batches to train the ORM on; run the trainer and "
            "rollout workers first"
        )
    held = split_by_prompt(data["prompt_id"], ec.orm_holdout, cfg.seed)
    labels = np.asarray(data["label"], bool)
    tokens, mask, pos, targets = pack_judged(tok, data["prompt_ids"], data["solution_ids"], labels)
    train_ix, val_ix = np.flatnonzero(~held), np.flatnonzero(held)
    weights = class_weights(labels[train_ix])
    row_weight = np.zeros(labels.size, np.float32)
    row_weight[train_ix] = weights

    model_cfg = orm_model_config(run)
    fns, params = new_model(model_cfg, cfg.seed)
    base = base_server(run)
    init = "scratch"
    if model_cfg == cfg.model and 0 in base.versions():
        params = flat_to_params(fns, params, base.pull(0).tensors)
        init = "base"
    log(
        f"[orm] {len(train_ix)} training rows ({int(labels[train_ix].sum())} correct), "
        f"{len(val_ix)} held-out rows; model {model_cfg.preset} init from {init}"
    )

    def validate(params) -> dict[str, Any]:
        model = fns.merge(params)
        val_p = [data["prompt_ids"][i] for i in val_ix]
        val_s = [data["solution_ids"][i] for i in val_ix]
        return judge_metrics(
            self_scores(model, tok, val_p, val_s, batch_size=ec.batch_size), labels[val_ix]
        )

    before = validate(params)
    steps = ec.orm_steps
    tx = make_optimizer(ec.orm_lr, max(1, steps // 10), max(steps, 1), 0.01, 1.0)
    opt_state = tx.init(params)

    step_fn = verdict_step(fns, tx)

    losses: list[float] = []
    for step in range(steps):
        rng = np.random.default_rng([cfg.seed, ORM_SEED_STREAM, step])
        ix = train_ix[rng.integers(0, len(train_ix), ec.orm_batch_size)]
        params, opt_state, loss = step_fn(
            params, opt_state, tokens[ix], mask[ix], pos[ix], row_weight[ix]
        )
        if (step + 1) % log_every == 0 or step == 0 or step + 1 == steps:
            losses.append(float(loss))
            run.log_metrics("orm_train", step + 1, {"step": step + 1, "loss": float(loss)})
            log(f"[orm] step {step + 1}/{steps} verdict loss {float(loss):.4f}")
    after = validate(params)
    summary = {
        "init": init,
        "model": dataclasses.asdict(model_cfg),
        "steps": steps,
        "train_rows": int(len(train_ix)),
        "train_positives": int(labels[train_ix].sum()),
        "val_rows": int(len(val_ix)),
        "val_positives": int(labels[val_ix].sum()),
        "val_before": before,
        "val": after,
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "seconds": time.time() - t0,
    }
    server.publish(
        0,
        params_to_flat(fns, params),
        epoch=server.acquire_epoch(),
        metadata={"source": "orm", **summary},
    )
    run.log_metrics("orm", 0, summary)
    auc = after["auc"]
    log(
        f"[orm] published: held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}"
        f", balanced {before['balanced_accuracy']:.3f} -> {after['balanced_accuracy']:.3f}, "
        f"AUC {'n/a' if auc is None else f'{auc:.3f}'} ({time.time() - t0:.0f}s)"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_jobs.orm", description=__doc__)
    parser.add_argument("--run", required=True, help="run URL (directory or gs://bucket/prefix)")
    args = parser.parse_args(argv)
    train_orm(Run.open(args.run), log=lambda m: print(m, flush=True))
    return 0


if __name__ == "__main__":
    from pipeline.entrypoint import run_main

    sys.exit(run_main("orm", main))
