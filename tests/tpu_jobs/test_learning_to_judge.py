"""Learning to judge: config, the rollout format's judge rows, the worker's judge groups on
planted solutions, the loss mask in the trainer, and a tiny run with judging on."""

from __future__ import annotations

import io
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, RolloutConfig
from pipeline.parquet_bytes import table_from_bytes
from pipeline.rollouts import SCHEMA, RolloutBatch, from_parquet_bytes, to_parquet_bytes
from pipeline.run import base_server
from pipeline.tasks import get_task
from pipeline.tasks.arithmetic import ArithmeticTask, columns, render
from pipeline.tasks.judge import JUDGE_SUFFIX, judge_reward
from pipeline.tokenizer import get_tokenizer
from tests.runs import clone_run, tiny_config
from tpu_jobs import rollout_worker as rw
from tpu_jobs.generate.interface import SampleResult
from tpu_jobs.learning.step import Learner
from tpu_jobs.model.batching import round_up
from tpu_jobs.model.judge import VERDICT_MAX_TOKENS, judged_completion_len, suffix_ids
from tpu_jobs.trainer import Trainer

TOK = get_tokenizer("char")
SUFFIX = suffix_ids(TOK)
ARITH = ArithmeticTask()


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fraction, p, judge", [(0.0, 4, 0), (0.25, 4, 1), (0.1, 4, 1), (0.5, 32, 16), (0.99, 4, 3)]
)
def test_judge_groups(fraction, p, judge):
    rc = RolloutConfig(prompts_per_batch=p, judge_fraction=fraction)
    assert rc.judge_groups() == judge and rc.solve_groups() == p - judge


def test_judge_fraction_is_validated():
    assert tiny_config("rollout.judge_fraction=0.25").rollout.judge_fraction == 0.25
    for bad in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match=r"rollout.judge_fraction.*\[0, 1\)"):
            tiny_config(f"rollout.judge_fraction={bad}")
    with pytest.raises(ConfigError, match="prompts_per_batch=1"):
        RolloutConfig(prompts_per_batch=1, judge_fraction=0.5)


# --------------------------------------------------------------------------------------
# Rollout format
# --------------------------------------------------------------------------------------


def _problem(a: int, b: int):
    return ARITH.make("+", a, b)


def _solution(problem, answer: int | None = None) -> str:
    """The teacher's worked solution, with its final answer replaced by `answer`."""
    text = ARITH.teacher_solution(problem, np.random.default_rng(0), tiny_config().task.arithmetic)
    if answer is not None:
        text = text[: text.rfind("#") + 1] + str(answer)
    return text


def _hand_batch(context_logp: float = 0.0, mask: bool = True) -> RolloutBatch:
    """One solve group and one judge group (G=4) on the problem 12+34.

    The judge group judges a wrong solution; its verdicts are y, n, n, y (+ EOS), so its
    rewards are 0, 1, 1, 0. `context_logp` is written as the behaviour log-prob of the
    (masked) solution + suffix tokens; `mask=False` drops the loss mask."""
    q = _problem(12, 34)
    prompt = TOK.encode_prompt(q.prompt)
    good, bad = _solution(q), _solution(q, 47)
    solve = [TOK.encode_completion(t) for t in (good, bad, bad, good)]
    ctx = TOK.encode(bad) + SUFFIX
    verdicts = [TOK.encode_completion(v) for v in "ynny"]
    judge = [ctx + v for v in verdicts]
    return RolloutBatch(
        batch_index=0,
        prompt_pos=np.zeros(8, np.int32),
        prompt_id=[q.problem_id] * 8,
        task=[q.task] * 8,
        sample_index=np.tile(np.arange(4), 2),
        prompt_ids=[prompt] * 8,
        completion_ids=solve + judge,
        behaviour_logprobs=[[-0.5] * len(c) for c in solve]
        + [[context_logp] * len(ctx) + [-0.7, -0.01] for _ in judge],
        completion=[TOK.decode(c) for c in solve + judge],
        finished=np.ones(8, bool),
        reward=np.array([1, 0, 0, 1, 0, 1, 1, 0], np.float32),
        policy_version=0,
        worker_id="w0",
        kind=["solve"] * 4 + ["judge"] * 4,
        loss_mask=[None] * 4 + [[0] * len(ctx) + [1, 1] for _ in judge] if mask else None,
    )


def test_judge_rows_round_trip_and_old_batches_still_read():
    b = _hand_batch()
    r = from_parquet_bytes(to_parquet_bytes(b))
    assert r.kind == b.kind and r.loss_mask == b.loss_mask
    np.testing.assert_array_equal(r.is_judge(), [False] * 4 + [True] * 4)
    assert r.token_mask(0) == [1] * len(b.completion_ids[0])
    assert r.token_mask(4)[-2:] == [1, 1] and sum(r.token_mask(4)) == 2
    # A batch written before the optional columns: every row a solve row, all-ones mask.
    table = table_from_bytes(to_parquet_bytes(b)).select(SCHEMA.names)
    assert table.schema == SCHEMA
    sink = io.BytesIO()
    pq.write_table(table, sink)
    old = from_parquet_bytes(sink.getvalue())
    assert old.kind is None and old.loss_mask is None
    assert not old.is_judge().any()
    assert old.token_mask(5) == [1] * len(b.completion_ids[5])
    with pytest.raises(ValueError, match="loss_mask has"):
        to_parquet_bytes(replace(b, loss_mask=[None] * 4 + [[1]] * 4))
    with pytest.raises(ValueError, match="kind"):
        to_parquet_bytes(replace(b, kind=["solve"] * 7 + ["other"]))


# --------------------------------------------------------------------------------------
# The worker's judge groups, on planted solutions with forced verdicts
# --------------------------------------------------------------------------------------


class ForcedVerdicts:
    """A stand-in sampler: sample s of every judge group writes VERDICTS[s] (+ EOS)."""

    VERDICTS = ["y", "n", "x", "y"]  # "x": unparseable, always rewarded 0

    def __init__(self):
        self.calls = []

    def generate(self, model, prompts, keys, params):
        max_new_tokens = params.max_new_tokens
        self.calls.append((prompts, np.asarray(jax.random.key_data(keys)), max_new_tokens))
        n = len(prompts)
        tokens = np.zeros((n, max_new_tokens), np.int32)
        for i in range(n):
            tokens[i, :2] = TOK.encode_completion(self.VERDICTS[i % 4])
        logprobs = np.where(tokens > 0, -0.25, 0.0).astype(np.float32)
        return SampleResult(tokens, logprobs, np.full(n, 2, np.int32), np.ones(n, bool))


def _planted_round():
    """A round-0 result of 2 solve slots x G=4 with planted correct / wrong solutions."""
    problems = [_problem(12, 34), _problem(7, 5)]
    texts = [
        [_solution(problems[0]), _solution(problems[0], 40), _solution(problems[0], 41), "#46"],
        [_solution(problems[1], 2), _solution(problems[1]), "12", _solution(problems[1], 13)],
    ]
    # Unfinished samples (no EOS) for some rows: the context must not depend on it.
    completions = [
        TOK.encode_completion(t) if s % 2 == 0 else TOK.encode(t)
        for row in texts
        for s, t in enumerate(row)
    ]
    verified = np.array(
        [ARITH.verify(q, t) for q, row in zip(problems, texts, strict=True) for t in row],
        np.float32,
    )
    np.testing.assert_array_equal(verified, [1, 0, 0, 1, 0, 1, 0, 0])
    return {
        "problems": problems,
        "slots": np.arange(2),
        "prompts": [TOK.encode_prompt(q.prompt) for q in problems for _ in range(4)],
        "completions": completions,
        "verified": verified,
    }


@pytest.mark.parametrize("index", [0, 1])
def test_judge_groups_reward_the_verifier_match(index):
    cfg = tiny_config("rollout.judge_fraction=0.5")  # P=4: 2 solve + 2 judge groups
    worker = object.__new__(rw.RolloutWorker)
    worker.cfg, worker.tok, worker.model = cfg, TOK, None
    worker.sampler = ForcedVerdicts()
    r = _planted_round()
    cols = worker._judge_groups(index, r)
    g = cfg.rollout.group_size
    ((prompts, keys, max_new),) = worker.sampler.calls
    assert max_new == VERDICT_MAX_TOKENS and len(prompts) == 2 * g and keys.shape == (2 * g, 2)
    judged = []
    for j in range(2):
        rows = range(j * g, (j + 1) * g)
        slot = cols["pos"][j * g]  # the slot whose sample is judged (slots are 0, 1 here)
        prompt = r["prompts"][slot * g]
        assert {tuple(cols["pr"][i]) for i in rows} == {tuple(prompt)}
        assert all(cols["pos"][i] == slot for i in rows)
        ctx = cols["co"][j * g][:-2]
        assert ctx[-len(SUFFIX) :] == SUFFIX and ctx[-len(SUFFIX) - 1] == TOK.eos_id
        assert ctx.count(TOK.eos_id) == 1
        solution = TOK.decode(ctx[: -len(SUFFIX) - 1])
        # The judged solution is one of that slot's samples (ending in EOS) ...
        candidates = [TOK.decode(c) for c in r["completions"][slot * g : (slot + 1) * g]]
        assert solution in candidates
        judged.append((slot, solution))
        correct = ARITH.verify(r["problems"][slot], solution) >= 1.0
        # ... correct when index + j is even, wrong when odd: balanced over the batch.
        assert correct == ((index + j) % 2 == 0)
        for s, i in enumerate(rows):
            assert prompts[i] == prompt + ctx  # the sampler saw prompt | solution | suffix
            verdict = ForcedVerdicts.VERDICTS[s]
            assert cols["co"][i] == ctx + TOK.encode_completion(verdict)
            assert cols["rw"][i] == judge_reward(verdict, correct)
            assert cols["rw"][i] == float(verdict == ("y" if correct else "n"))
            assert cols["mask"][i] == [0] * len(ctx) + [1, 1]
            assert cols["lp"][i] == [0.0] * len(ctx) + [-0.25, -0.25]
            assert cols["tx"][i] == solution + JUDGE_SUFFIX + verdict
    assert len(set(judged)) == 2  # drawn without replacement
    # Reproducible: the same batch index picks the same solutions with the same keys.
    again = object.__new__(rw.RolloutWorker)
    again.cfg, again.tok, again.model, again.sampler = cfg, TOK, None, ForcedVerdicts()
    assert again._judge_groups(index, r) == cols
    np.testing.assert_array_equal(again.sampler.calls[0][1], keys)


# --------------------------------------------------------------------------------------
# The trainer: only verdict tokens carry loss
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def judge_cfg():
    return tiny_config("rollout.judge_fraction=0.25", "trainer.algorithm=grpo")


def _step(learner: Learner, batch: RolloutBatch):
    """One step from the learner's initial params (the KL reference: the same params)."""
    policy = learner.template[0]["policy"]
    params, opt = learner.init_state(jax.tree.map(jnp.copy, policy))
    ref = jax.tree.map(jnp.copy, policy)
    params, _, metrics = learner.step(params, opt, ref, learner.inputs(batch))
    return jax.tree.map(np.asarray, params), metrics


def test_loss_mask_keeps_only_the_verdict_tokens(judge_cfg):
    batch = _hand_batch()
    prompt_len = round_up(max(len(p) for p in batch.prompt_ids), 8)
    learner = Learner(judge_cfg, prompt_len, fused=False)
    assert learner.completion_len == judged_completion_len(64, TOK) == 64 + 1 + len(SUFFIX) + 2
    inp = learner.inputs(batch)
    cm = np.asarray(inp.comp_mask)
    for i in range(4):
        assert cm[i].sum() == len(batch.completion_ids[i])
    for i in range(4, 8):
        n = len(batch.completion_ids[i])
        np.testing.assert_array_equal(np.flatnonzero(cm[i]), [n - 2, n - 1])

    params, metrics = _step(learner, batch)
    # The behaviour log-probs of masked tokens change nothing.
    params_b, metrics_b = _step(learner, _hand_batch(context_logp=-9.0))
    assert metrics_b == metrics
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_array_equal(a, b)
    # Reference: the judged solution + suffix moved into the prompt (plain rows, no mask).
    ref_batch = _hand_batch()
    for i in range(4, 8):
        c = ref_batch.completion_ids[i]
        ref_batch.prompt_ids[i] = ref_batch.prompt_ids[i] + c[:-2]
        ref_batch.completion_ids[i] = c[-2:]
        ref_batch.behaviour_logprobs[i] = ref_batch.behaviour_logprobs[i][-2:]
    ref_batch = replace(ref_batch, loss_mask=None, kind=None)
    wide = Learner(judge_cfg, round_up(max(len(p) for p in ref_batch.prompt_ids), 8), fused=False)
    ref_params, ref_metrics = _step(wide, ref_batch)
    for key in ("loss", "grad_norm", "pg_loss", "adv_std", "logprob_absdiff_max"):
        if key in metrics:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # Without the mask the solution tokens would be trained too: a different step.
    _, unmasked = _step(learner, _hand_batch(mask=False))
    assert metrics["grad_norm"] > 0
    assert unmasked["grad_norm"] != pytest.approx(metrics["grad_norm"], rel=1e-3)


def test_judge_loss_weight_scales_the_judge_rows(judge_cfg):
    """trainer.judge_loss_weight: the weight sits on exactly the judge rows, and at 0 the
    judge group moves nothing: the step equals one where the judge group's rewards are
    constant (zero advantages; the KL term is 0 with gradient 0 at the reference)."""
    batch = _hand_batch()
    prompt_len = round_up(max(len(p) for p in batch.prompt_ids), 8)
    plain = Learner(judge_cfg, prompt_len, fused=False)
    assert plain.inputs(batch).row_weight is None  # weight 1: the unweighted programs
    cfg = tiny_config(
        "rollout.judge_fraction=0.25", "trainer.algorithm=grpo", "trainer.judge_loss_weight=0"
    )
    weighted = Learner(cfg, prompt_len, fused=False)
    w = np.asarray(weighted.inputs(batch).row_weight)
    assert w[:8].tolist() == [1, 1, 1, 1, 0, 0, 0, 0] and (w[8:] == 1).all()
    _, metrics = _step(weighted, batch)
    flat = replace(batch, reward=np.array([1, 0, 0, 1, 1, 1, 1, 1], np.float32))
    _, metrics_flat = _step(plain, flat)
    _, metrics_plain = _step(plain, batch)
    for key in ("grad_norm", "pg_loss", "loss"):
        assert metrics[key] == pytest.approx(metrics_flat[key], rel=1e-5, abs=1e-9), key
    # At weight 1 the judge group does carry gradient.
    assert metrics_plain["grad_norm"] > 1.05 * metrics["grad_norm"]


# --------------------------------------------------------------------------------------
# A tiny run with judging on: real judge groups from the SFT'd base, three trainer steps
# --------------------------------------------------------------------------------------


def test_tiny_run_with_judging(tiny_base, tmp_path):
    cfg = tiny_base.config
    cfg = replace(
        cfg,
        rollout=replace(cfg.rollout, judge_fraction=0.25),
        trainer=replace(cfg.trainer, steps=3, max_staleness=2, checkpoint_every=10),
    )
    run = clone_run(tiny_base, str(tmp_path / "run"), cfg)
    worker = rw.RolloutWorker(run, "w0", log=lambda m: None)
    from tpu_jobs.model.transformer import load_flat_params

    load_flat_params(worker.model, base_server(run).pull(0).tensors)
    worker.version = 0
    g, p = cfg.rollout.group_size, cfg.rollout.prompts_per_batch
    problems = {q.problem_id: q for q in worker.problems}
    from pipeline.leases import BatchLeases

    leases = BatchLeases(run.store, ttl_seconds=30)
    mixed = {}  # batch index -> whether some group's rewards differ (a policy gradient)
    for index in range(3):
        batch = worker.generate_batch(index, 0)
        mixed[index] = bool(np.ptp(batch.reward.reshape(-1, g), axis=1).max() > 0)
        assert len(batch) == p * g
        judge = batch.is_judge()
        assert judge.sum() == g * cfg.rollout.judge_groups() == g  # 1 judge group of 4
        assert not judge[: len(batch) - g].any()  # judge groups come last
        for i in np.flatnonzero(judge):
            mask = np.asarray(batch.token_mask(i))
            ids = np.asarray(batch.completion_ids[i])
            ctx, verdict = ids[mask == 0].tolist(), ids[mask == 1].tolist()
            assert ctx[-len(SUFFIX) :] == SUFFIX and 1 <= len(verdict) <= VERDICT_MAX_TOKENS
            q = problems[batch.prompt_id[i]]
            solution = TOK.decode(ctx[: -len(SUFFIX)])
            correct = get_task(q.task).verify(q, solution) >= 1.0
            assert batch.reward[i] == judge_reward(TOK.decode(verdict), correct)
            # The judged solution is one of the batch's own samples of that problem.
            same = [
                TOK.decode(batch.completion_ids[k])
                for k in np.flatnonzero(~judge)
                if batch.prompt_id[k] == batch.prompt_id[i]
            ]
            assert solution in same
            lp = np.asarray(batch.behaviour_logprobs[i])
            assert np.all(lp[mask == 0] == 0) and np.all(lp[mask == 1] < 0)
        assert worker.last_stats["judge_groups"] == 1
        leases.commit_batch(index, to_parquet_bytes(batch))
    state = Trainer(run, log=lambda m: None, fused=False).train()
    assert state.step == 3 and state.dropped == 0
    train = sorted(run.read_metrics("train"), key=lambda r: r["step"])
    assert len(train) == 3
    for rec in train:
        assert 0.0 <= rec["judge_reward_mean"] <= 1.0 and 0.0 <= rec["solve_reward_mean"] <= 1.0
        assert rec["judge_groups"] == 1 and rec["groups"] == p
        # Which groups are mixed depends on the sampled tokens (the CPU's rounding): an
        # all-constant batch has no policy gradient, so the gradient is checked where the
        # batch has one.
        assert np.isfinite(rec["loss"]) and (rec["grad_norm"] > 0 or not mixed[rec["batch_index"]])
        assert rec["logprob_absdiff_max"] < 1e-4 or rec["staleness"] > 0  # sampler = trainer
        want = (rec["solve_reward_mean"] * (p - 1) + rec["judge_reward_mean"]) / p
        assert rec["reward_mean"] == pytest.approx(want, abs=1e-6)


# --------------------------------------------------------------------------------------
# SFT: verdict demonstrations teach the format (without them "y"/"n" are ~never sampled)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("labels", ["random", "verifier", "balanced", "slips"])
def test_sft_judge_demonstrations(labels):
    from types import SimpleNamespace

    from tpu_jobs.sft import teacher_batch

    plain_cfg = tiny_config("sft.batch_size=64")
    cfg = tiny_config("sft.batch_size=64", "sft.judge_fraction=0.5", f"sft.judge_labels={labels}")
    problems = [ARITH.make("+", a, b) for a in (17, 58, 99, 6) for b in (25, 7, 83)]
    c_len = judged_completion_len(plain_cfg.sampler.max_new_tokens, TOK)
    out = {}
    for name, c in (("plain", plain_cfg), ("judge", cfg)):
        tokens, mask, comp = teacher_batch(SimpleNamespace(config=c), problems, 3, TOK, 16, c_len)
        out[name] = [tokens[r, 16:][comp[r] > 0].tolist() for r in range(len(tokens))]
    prompts = [TOK.decode(t[:16]) for t in tokens]
    judged, verdicts = 0, []
    for r, (plain, judge) in enumerate(zip(out["plain"], out["judge"], strict=True)):
        if plain == judge:
            continue
        judged += 1
        # The solution and its EOS (as a solve demonstration ends it: nothing teaches the
        # solver to write the suffix after its answer), then suffix, verdict, EOS; the
        # teacher's draws do not move (with "balanced" the judged solution is re-drawn
        # from the judge stream instead).
        solution = judge[: -3 - len(SUFFIX)]
        assert judge[-3 - len(SUFFIX)] == TOK.eos_id
        assert judge[-2 - len(SUFFIX) : -2] == SUFFIX and judge[-1] == TOK.eos_id
        if labels not in ("balanced", "slips"):
            assert solution == plain[:-1]
            assert judge[: len(plain)] == plain  # the solve demonstration, EOS included
        verdict = TOK.decode(judge[-2:-1])
        assert verdict in ("y", "n")
        verdicts.append(verdict)
        if labels != "random":
            q = next(p for p in problems if p.prompt == prompts[r])
            correct = ARITH.verify(q, TOK.decode(solution)) >= 1.0
            assert verdict == ("y" if correct else "n")
    assert 16 < judged < 48  # about half of 64
    if labels in ("balanced", "slips"):  # a fair coin, whatever the problem
        assert 0.25 < verdicts.count("y") / judged < 0.75


def test_judged_solutions_are_balanced_when_correct_ones_are_rare():
    """One correct sample in the whole round, in slot 1: judge group 0 (even) still judges
    it, group 1 (odd) a wrong one; judging only slot 0 would have found no correct one."""
    cfg = tiny_config("rollout.judge_fraction=0.5")
    worker = object.__new__(rw.RolloutWorker)
    worker.cfg, worker.tok, worker.model = cfg, TOK, None
    worker.sampler = ForcedVerdicts()
    r = _planted_round()
    r["verified"] = np.array([0, 0, 0, 0, 0, 1, 0, 0], np.float32)  # only row 5 (slot 1)
    g = cfg.rollout.group_size
    cols = worker._judge_groups(0, r)
    assert cols["pos"][0] == 1  # group 0 judges the one correct sample, in slot 1
    assert cols["tx"][0].startswith(TOK.decode(r["completions"][5]).rstrip())
    # ForcedVerdicts: sample 0 says "y", sample 1 says "n".
    assert (cols["rw"][0], cols["rw"][1]) == (1.0, 0.0)  # correct solution
    assert (cols["rw"][g], cols["rw"][g + 1]) == (0.0, 1.0)  # wrong solution


@pytest.mark.parametrize("index", [0, 1, 2])
def test_judged_solutions_in_same_problem_pairs(index):
    """judge_pick=problem: groups 2m, 2m+1 judge a correct and a wrong sample of one mixed
    problem (slots 1 and 3 here; slots 0 and 2 are all wrong / all correct)."""
    g, n_judge = 4, 6
    verified = np.array([0, 0, 0, 0, 1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 0, 0], bool)
    rows = rw.pick_judged_by_problem(verified, g, n_judge, index, np.random.default_rng(index))
    assert len(rows) == n_judge
    for m in range(n_judge // 2):
        a, b = rows[2 * m], rows[2 * m + 1]
        assert a // g == b // g and a // g in (1, 3)  # same mixed problem
        assert verified[a] != verified[b]  # one correct, one wrong
        assert verified[a] == ((index + 2 * m) % 2 == 0)  # even j: the correct one
    assert {r // g for r in rows} == {1, 3}  # the pairs cycle over both mixed problems


def test_judge_pick_by_problem_falls_back_without_mixed_problems():
    verified = np.array([0, 0, 1, 1], bool)  # slot 0 all wrong, slot 1 all correct
    rows = rw.pick_judged_by_problem(verified, 2, 2, 0, np.random.default_rng(0))
    assert verified[rows[0]] and not verified[rows[1]]  # the round-wide draw, balanced
    assert tiny_config("rollout.judge_pick=problem").rollout.judge_pick == "problem"
    with pytest.raises(ConfigError, match="rollout.judge_pick"):
        tiny_config("rollout.judge_pick=slot")


def test_balanced_sft_labels_do_not_depend_on_the_problem():
    """sft.judge_labels=balanced: the coin decides correct ("y") or wrong ("n") for the
    same problem; a problem without carries cannot be wrong and keeps "y"."""
    from tpu_jobs.sft import label_balanced

    sft = tiny_config().task.arithmetic  # the family options (its teacher)
    carries, none = ARITH.make("+", 58796, 47658), ARITH.make("+", 12, 34)
    rng = np.random.default_rng(0)
    for coin in (True, False) * 5:
        text, verdict = label_balanced(ARITH, carries, "unused", coin, rng, sft)
        assert (ARITH.verify(carries, text) >= 1.0) == coin
        assert verdict == ("y" if coin else "n")
    text, verdict = label_balanced(ARITH, none, "unused", False, rng, sft)
    assert ARITH.verify(none, text) == 1.0 and verdict == "y"


def test_slips_labels_show_half_the_wrong_solutions_as_slips():
    """sft.judge_labels=slips: a wrong demonstration is a slip (not any chain the teacher's
    dropped carries can write) about half the time, the teacher's own mistake otherwise,
    and always labelled "n"; a correct one stays the clean teacher's."""
    from itertools import product

    from tpu_jobs.sft import label_slips

    options = tiny_config().task.options_for("arithmetic")
    p = ARITH.make("+", 4567, 1234, width=4)  # carries out of columns a and b
    op, a, b = p.meta["op"], p.meta["a"], p.meta["b"]
    teacher = {render("+", *columns(op, a, b, np.array(m)), 4) for m in product([0, 1], repeat=4)}
    rng = np.random.default_rng(5)
    slips = 0
    for _ in range(200):
        text, verdict = label_slips(ARITH, p, "", False, rng, options)
        assert verdict == "n" and ARITH.verify(p, text) == 0.0
        slips += text not in teacher
    assert 70 < slips < 130  # Binomial(200, ~0.5 x 0.9)
    text, verdict = label_slips(ARITH, p, "", True, rng, options)
    assert (text, verdict) == (render("+", *columns(op, a, b), 4), "y")


def test_every_judge_label_kind_the_config_allows_has_a_labeller():
    from pipeline.config import JUDGE_LABEL_KINDS
    from tpu_jobs.sft import JUDGE_LABELS

    assert tuple(JUDGE_LABELS) == JUDGE_LABEL_KINDS
