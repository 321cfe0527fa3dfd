"""The trainer's algorithm suite: config wiring, one real step per preset, the value head,
finite-difference gradients through the tiny model, staleness and empty-batch drops, and
DAPO's dynamic sampling on the rollout side.

Compiled work is shared: the model's forward/backward programs are cached per model and
shape (`tpu_jobs.learning.step.model_programs`), so each extra algorithm compiles only its
loss head.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline import algorithms as A
from pipeline import config as C
from pipeline.leases import BatchLeases
from pipeline.paramserver.adapters import PolicyReader
from pipeline.rollouts import RolloutBatch, from_parquet_bytes, to_parquet_bytes
from pipeline.run import DONE_KEY, base_server
from pipeline.tasks import get_task
from tests.runs import clone_run, with_algorithm, with_teacher
from tpu_jobs import rollout_worker as rw
from tpu_jobs.learning import losses as L
from tpu_jobs.learning.step import Learner
from tpu_jobs.learning.value_head import hidden_states, init_value_head, lm_logits, policy_forward
from tpu_jobs.model.state import split_model
from tpu_jobs.model.transformer import (
    init_model,
    load_flat_params,
    positions_from_mask,
    sequence_logprobs,
)
from tpu_jobs.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def with_trainer(cfg: C.RunConfig, **changes) -> C.RunConfig:
    return with_algorithm(cfg, changes.pop("algorithm", cfg.trainer.algorithm), **changes)


# --------------------------------------------------------------------------------------
# Config wiring (no jax work)
# --------------------------------------------------------------------------------------


def test_every_declared_part_has_an_implementation():
    """pipeline/algorithms.py declares the names (no jax); tpu_jobs/learning/losses.py implements
    each one, and the config's preset names are the spec's."""
    assert tuple(L.ALGORITHMS) == C.ALGORITHMS
    for declared, implemented in (
        (A.ADVANTAGES, L.ADVANTAGES),
        (A.POLICY_LOSSES, L.POLICY_LOSSES),
        (A.AGGREGATIONS, L.AGGREGATIONS),
        (A.KL_ESTIMATORS, L.KL_ESTIMATORS),
        (A.VALUE_LOSSES, L.VALUE_LOSSES),
        (A.IS_CORRECTIONS, L.IS_CORRECTIONS),
    ):
        assert tuple(implemented) == tuple(declared)
    assert tuple(L.DENOMINATORS) == A.DENOMINATORS
    # The flat spelling `trainer.<hyper-parameter>` folds into `trainer.loss`: no trainer
    # field may carry a loss hyper-parameter's name.
    trainer_fields = {f.name for f in dataclasses.fields(C.TrainerConfig)}
    assert not trainer_fields & A.OVERRIDE_KEYS


def test_registering_an_undeclared_name_fails_loudly():
    with pytest.raises(KeyError, match="vtrace"):
        A.implementations(A.ADVANTAGES, {"grpo": L.grpo_advantages, "vtrace": len})


@pytest.mark.parametrize("alg", C.ALGORITHMS)
def test_default_trainer_config_is_exactly_the_preset(alg):
    tc = C.TrainerConfig(algorithm=alg)
    assert L.loss_spec(alg, **tc.loss_overrides()) == L.ALGORITHMS[alg]


# A distillation preset's run names its teacher run, so it has no stand-alone file.
@pytest.mark.parametrize("alg", [a for a in C.ALGORITHMS if not A.PRESETS[a].needs_teacher])
def test_algorithm_config_files_spell_out_their_preset(alg):
    cfg = C.load_config(ROOT / "configs" / "algorithms" / f"{alg}.yaml")
    assert cfg.trainer.algorithm == alg
    spec = L.loss_spec(alg, **cfg.trainer.loss_overrides())
    # The files only add the off-policy correction (TIS, C = 2) to the preset.
    assert spec == L.ALGORITHMS[alg].replace(is_correction="tis", is_cap=2.0)
    assert cfg.trainer.uses_dynamic_sampling() == (alg == "dapo")


def test_overrides_and_sentinels():
    gspo = C.load_config(None, ["trainer.algorithm=gspo", "trainer.kl_coef=1e-3"]).trainer
    spec = L.loss_spec("gspo", **gspo.loss_overrides())
    assert (spec.eps_low, spec.eps_high) == (3e-4, 4e-4)  # not overwritten by a default
    assert spec.kl_coef == pytest.approx(1e-3) and isinstance(gspo.loss["kl_coef"], float)
    tc = C.TrainerConfig(
        algorithm="grpo", loss={"clip_eps": 0.1, "eps_high": 0.3, "kl_estimator": "k2"}
    )
    spec = L.loss_spec("grpo", **tc.loss_overrides())
    assert (spec.eps_low, spec.eps_high, spec.kl_estimator) == (0.1, 0.3, "k2")
    assert C.TrainerConfig(algorithm="dapo").uses_dynamic_sampling()
    assert not C.TrainerConfig(algorithm="grpo").uses_dynamic_sampling()
    assert C.TrainerConfig(algorithm="dapo").overlong_cache(64) == 13  # 0.2 * L_max
    assert C.TrainerConfig(algorithm="dapo", overlong_buffer=0).overlong_cache(64) == 0
    assert C.TrainerConfig(algorithm="grpo", dynamic_sampling=True).uses_dynamic_sampling()
    for override, words in (
        ("trainer.algorithm=ppo2", ["trainer.algorithm", "'cispo'"]),
        ("trainer.advantage=vtrace", ["trainer.advantage", "'gae'"]),
        ("trainer.kl_estimator=k4", ["trainer.kl_estimator", "'k3'"]),
        ("trainer.is_correction=ratio", ["trainer.is_correction", "'tis'"]),
        ("trainer.old_logprobs=sampler", ["trainer.old_logprobs", "'behaviour'"]),
        ("trainer.eps_low=1.5", ["trainer.eps_low", "[0, 1]"]),
        ("trainer.gamma=fast", ["trainer.gamma", "float"]),
    ):
        with pytest.raises(C.ConfigError) as err:
            C.load_config(None, [override])
        for w in words:
            assert w in str(err.value), (override, str(err.value))


# --------------------------------------------------------------------------------------
# Value head and forward pass
# --------------------------------------------------------------------------------------


def test_hidden_state_path_reproduces_the_model_exactly():
    cfg = C.ModelConfig(preset="tiny")
    model = init_model(cfg, 1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (3, 12)), jnp.int32)
    mask = np.ones((3, 12), np.int32)
    mask[0, :4] = 0  # left padding
    mask[1, 9:] = 0  # right padding
    mask = jnp.asarray(mask)
    logits, _ = model(tokens, positions_from_mask(mask), mask)
    again = lm_logits(model, hidden_states(model, tokens, mask))
    assert np.array_equal(np.asarray(logits), np.asarray(again))
    value = init_value_head(cfg.hidden_size)
    value = {"kernel": value["kernel"] + 0.1, "bias": value["bias"] + 0.5}
    out = policy_forward(model, tokens, mask, 0.7, value, entropy=True)
    ref = sequence_logprobs(model, tokens, mask, 0.7)
    assert np.array_equal(np.asarray(out.logp), np.asarray(ref))
    # Values and entropy of token t come from the prefix ending at t - 1.
    h = np.asarray(hidden_states(model, tokens, mask))
    np.testing.assert_allclose(
        np.asarray(out.values)[2, 5], h[2, 4] @ np.full(cfg.hidden_size, 0.1) + 0.5, rtol=1e-5
    )
    p = jax.nn.softmax(np.asarray(logits)[2, 4] / 0.7)
    np.testing.assert_allclose(np.asarray(out.entropy)[2, 5], -(p * np.log(p)).sum(), rtol=1e-5)
    assert np.all(np.asarray(out.values)[mask == 0] == 0)
    assert np.all(np.asarray(out.values)[:, 0] == 0)


# --------------------------------------------------------------------------------------
# Gradients through the tiny model vs finite differences (float32: directional checks)
# --------------------------------------------------------------------------------------


def _directional_check(f, params, seeds=(0, 1, 2), h=1e-3):
    value_and_grad = jax.jit(jax.value_and_grad(f))  # one compiled program for both
    grad = value_and_grad(params)[1]

    def f_jit(x):
        return value_and_grad(x)[0]

    leaves, treedef = jax.tree.flatten(params)
    for seed in seeds:
        rng = np.random.default_rng(seed)
        vs = [rng.normal(size=x.shape).astype(np.float32) for x in leaves]
        norm = np.sqrt(sum(float((v * v).sum()) for v in vs))
        v = jax.tree.unflatten(treedef, [jnp.asarray(x / norm) for x in vs])

        def at(s, v=v):
            return float(f_jit(jax.tree.map(lambda w, dw: w + s * dw, params, v)))

        fd = (at(h) - at(-h)) / (2 * h)
        pairs = zip(jax.tree.leaves(grad), jax.tree.leaves(v), strict=True)
        ad = sum(float(jnp.vdot(g, d)) for g, d in pairs)
        assert abs(fd - ad) <= 2e-3 * max(abs(ad), 0.05), (seed, fd, ad)


def _model_batch(cfg: C.ModelConfig):
    rng = np.random.default_rng(3)
    b, p, c = 6, 5, 7
    tokens = rng.integers(4, cfg.vocab_size, (b, p + c)).astype(np.int32)
    mask = np.ones((b, p + c), np.int32)
    mask[0, :2] = 0
    mask[1, p + 4 :] = 0
    mask[5, p:] = 0  # an empty completion
    comp = mask[:, p:].astype(np.float32)
    return jnp.asarray(tokens), jnp.asarray(mask), comp, p


@pytest.mark.parametrize("alg", ["grpo", "ppo"])
def test_loss_gradient_through_tiny_model_matches_finite_differences(alg):
    cfg = C.ModelConfig(preset="tiny")
    fns, params = split_model(init_model(cfg, 2))
    tokens, mask, comp, p = _model_batch(cfg)
    logp0 = np.asarray(sequence_logprobs(fns.merge(params), tokens, mask))[:, p:]
    # pi_old away from pi so some tokens sit far beyond both clip bounds (0.8 / 1.2) and
    # the rest well inside: the finite-difference steps cross no kink.
    shift = np.random.default_rng(4).choice([-1.0, -0.05, 0.0, 0.05, 1.0], logp0.shape)
    logp_old = jnp.asarray((logp0 + shift) * comp, jnp.float32)
    rewards = jnp.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], jnp.float32)
    logp_ref = jnp.asarray(logp0 - 0.1 * comp, jnp.float32)
    spec = L.ALGORITHMS[alg].replace(kl_coef=0.05)
    if alg == "grpo":

        def f(prm):
            logp = sequence_logprobs(fns.merge(prm), tokens, mask)[:, p:]
            return L.compute_loss(
                spec, logp, logp_old, comp, rewards=rewards, group_size=3, logp_ref=logp_ref
            )[0]

        train = params
    else:
        value0 = {"kernel": jnp.full((cfg.hidden_size, 1), 0.05), "bias": jnp.zeros(1)}
        old_values = policy_forward(fns.merge(params), tokens, mask, 1.0, value0).values[:, p:]

        def f(prm):
            out = policy_forward(fns.merge(prm["policy"]), tokens, mask, 1.0, prm["value"])
            return L.compute_loss(
                spec,
                out.logp[:, p:],
                logp_old,
                comp,
                rewards=rewards,
                logp_ref=logp_ref,
                values=out.values[:, p:],
                old_values=old_values,
            )[0]

        train = {"policy": params, "value": value0}
    _, metrics = L.compute_loss(
        spec.replace(vf_coef=0.0, advantage="grpo", kl_coef=0.0),
        jnp.asarray(logp0),
        logp_old,
        comp,
        rewards=rewards,
        group_size=3,
    )
    assert float(metrics["clip_frac"]) > 0  # clipped tokens are part of the check
    _directional_check(f, train)


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo", "cispo", "reinforce"])
def test_extreme_ratios_hit_both_clip_bounds_and_stay_finite(policy_loss):
    # log-ratios of +-40 (beyond MAX_LOG_RATIO) with both advantage signs.
    lo = np.zeros((4, 3), np.float32)
    lp = np.array([[40, 40, 40], [-40, -40, -40], [40, 40, 40], [-40, -40, -40]], np.float32)
    adv = np.array([1.0, -1.0, -1.0, 1.0], np.float32)
    mask = np.ones((4, 3), np.float32)
    spec = L.LossSpec(policy_loss=policy_loss, aggregation="token_mean")
    (loss, m), g = jax.value_and_grad(
        lambda x: L.compute_loss(spec, x, lo, mask, advantages=adv), has_aux=True
    )(jnp.asarray(lp))
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))
    assert all(np.isfinite(float(v)) for v in m.values())
    if policy_loss in ("ppo_clip", "gspo"):
        assert float(m["clip_frac_high"]) == pytest.approx(0.25)  # row 0: r >> 1, A > 0
        assert float(m["clip_frac_low"]) == pytest.approx(0.25)  # row 1: r << 1, A < 0
        assert np.all(np.asarray(g)[:2] == 0.0)  # clipped: no gradient


# --------------------------------------------------------------------------------------
# Real batches from the SFT'd tiny base
# --------------------------------------------------------------------------------------


def _worker_at_base(run, worker_id="w0"):
    worker = rw.RolloutWorker(run, worker_id, log=lambda m: None)
    snap = base_server(run).pull(base_server(run).latest_version())
    load_flat_params(worker.model, snap.tensors)
    worker.version = 0
    return worker


@pytest.fixture(scope="module")
def grpo_run(tiny_base, tmp_path_factory):
    cfg = with_trainer(tiny_base.config, algorithm="grpo", steps=2, max_staleness=0)
    return clone_run(tiny_base, str(tmp_path_factory.mktemp("grpo") / "run"), cfg)


@pytest.fixture(scope="module")
def worker(grpo_run):
    """The real rollout worker holding the base model (version 0)."""
    return _worker_at_base(grpo_run)


@pytest.fixture(scope="module")
def real_batch(worker):
    """The first batch of the tiny run, sampled from the base model by the real worker,
    whose rewards are not all equal (the steps below need a real gradient).

    Why it holds on any CPU: which rows are right depends on the sampled tokens, i.e. on
    the CPU's rounding, and one batch of 16 rows from a base with pass@1 ~0.3 is all wrong
    now and then; the first mixed one of eight batches is there unless all eight fail."""
    for index in range(8):
        batch = worker.generate_batch(index, 0)
        if 0.0 < batch.reward.mean() < 1.0:
            return batch
    raise AssertionError("8 batches of the base model, none with mixed rewards")


@pytest.fixture(scope="module")
def trainer(grpo_run):
    return Trainer(grpo_run, log=lambda m: None, fused=False)


def _finite(metrics):
    bad = {k: v for k, v in metrics.items() if not np.isfinite(v)}
    assert not bad, bad


@pytest.mark.parametrize("alg", C.ALGORITHMS)
def test_every_algorithm_takes_a_real_step(alg, grpo_run, trainer, real_batch):
    cfg = with_trainer(grpo_run.config, algorithm=alg)
    learner = Learner(cfg, trainer.prompt_len, fused=False)  # shares compiled programs
    params, opt_state = learner.init_state(trainer._base_params())
    before = jax.tree.map(np.asarray, params)
    ref = trainer._base_params() if learner.needs_ref else None
    inputs = learner.inputs(with_teacher(real_batch) if learner.spec.needs_teacher else real_batch)
    params, opt_state, metrics = learner.step(params, opt_state, ref, inputs)
    _finite(metrics)
    assert metrics["grad_norm"] > 0
    assert metrics["ratio_mean"] == 1.0  # pi_old = the params at the start of the step
    assert metrics["logprob_absdiff_max"] < 1e-4  # float32 sampler vs trainer
    changed = jax.tree.map(lambda a, b: bool(np.any(a != np.asarray(b))), before, params)
    assert any(jax.tree.leaves(changed["policy"]))
    assert ("value" in params) == (alg == "ppo")
    if alg == "ppo":
        assert params["value"]["kernel"].shape == (cfg.model.hidden_size, 1)
        assert any(jax.tree.leaves(changed["value"]))
        assert "vf_loss" in metrics and "explained_variance" in metrics
    if learner.needs_ref:
        assert "kl_ref" in metrics


def test_micro_batches_and_several_updates_per_batch(grpo_run, trainer, real_batch):
    """Gradient accumulation equals the whole batch's gradient; with several updates per
    batch the later ones see ratios != 1 (the clip becomes active)."""
    cfg = grpo_run.config
    whole = Learner(with_trainer(cfg, algorithm="grpo"), trainer.prompt_len, fused=False)
    micro = Learner(with_trainer(cfg, algorithm="grpo", micro_batch=4), trainer.prompt_len)
    base = trainer._base_params()
    ref = trainer._base_params()
    out = []
    for learner in (whole, micro):
        params, opt = learner.init_state(jax.tree.map(jnp.copy, base))
        p, _, m = learner.step(params, opt, ref, learner.inputs(real_batch))
        out.append((jax.tree.map(np.asarray, p), m))
    (pa, ma), (pb, mb) = out
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-5)
    assert mb["loss"] == pytest.approx(ma["loss"], rel=1e-4, abs=1e-7)
    for a, b in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    several = Learner(
        with_trainer(cfg, algorithm="grpo", mini_batches=2, epochs=2, micro_batch=4, lr=3e-3),
        trainer.prompt_len,
    )
    params, opt = several.init_state(jax.tree.map(jnp.copy, base))
    _, _, m = several.step(params, opt, ref, several.inputs(real_batch))
    _finite(m)
    assert m["updates"] == 4
    assert m["ratio_max_last_update"] > 1.0 or m["ratio_min_last_update"] < 1.0


def test_fused_step_equals_the_shared_programs(grpo_run, trainer, real_batch):
    """The trainer's one-program step and the chained shared programs agree (PPO: value
    head, GAE, clipped value loss)."""
    cfg = with_trainer(grpo_run.config, algorithm="ppo")
    out = []
    for fused in (True, False):
        learner = Learner(cfg, trainer.prompt_len, fused=fused)
        assert learner.fused == fused
        params, opt = learner.init_state(trainer._base_params())
        p, _, m = learner.step(params, opt, None, learner.inputs(real_batch))
        out.append((jax.tree.map(np.asarray, p), m))
    (pa, ma), (pb, mb) = out
    assert set(ma) == set(mb)
    for key in ("loss", "pg_loss", "vf_loss", "grad_norm", "adv_std"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_value_head_is_checkpointed(tiny_base, tmp_path):
    cfg = with_trainer(tiny_base.config, algorithm="ppo")
    run = clone_run(tiny_base, str(tmp_path / "run"), cfg)
    t = Trainer(run, log=lambda m: None)
    state = t.restore_or_init()
    state.params["value"] = {"kernel": state.params["value"]["kernel"] + 0.25, "bias": jnp.ones(1)}
    t.ckpt.save(1, (state.params, state.opt_state), t._meta(state, 1))
    t.ckpt.wait()
    (params, _), meta = t.ckpt.restore_latest(t._template)
    assert meta["step"] == 0
    np.testing.assert_array_equal(params["value"]["kernel"], state.params["value"]["kernel"])
    np.testing.assert_array_equal(params["value"]["bias"], [1.0])


# --------------------------------------------------------------------------------------
# Off-policy bookkeeping: a too-old batch and an empty batch are dropped and counted
# --------------------------------------------------------------------------------------


def _relabel(batch: RolloutBatch, index: int, version: int) -> RolloutBatch:
    return replace(batch, batch_index=index, policy_version=version)


def test_empty_batches_are_dropped_and_staleness_is_counted(grpo_run, real_batch, tmp_path):
    # max_staleness=1, publish_every=1: batch i is made from version max(0, i - 1)
    # (pipeline.rollouts.required_version). Dynamic sampling: only it may commit an empty
    # batch (elsewhere the batch checks refuse one, tests/pipeline/test_batch_checks.py).
    cfg = with_trainer(grpo_run.config, dynamic_sampling=True, max_staleness=1, steps=3)
    run = clone_run(grpo_run, str(tmp_path / "run"), cfg)
    leases = BatchLeases(run.store, ttl_seconds=30)
    empty = RolloutBatch(
        batch_index=2,
        prompt_pos=np.zeros(0, np.int32),
        prompt_id=[],
        task=[],
        sample_index=np.zeros(0, np.int32),
        prompt_ids=[],
        completion_ids=[],
        behaviour_logprobs=[],
        completion=[],
        finished=np.zeros(0, bool),
        reward=np.zeros(0, np.float32),
        policy_version=1,
        worker_id="w0",
    )
    leases.commit_batch(0, to_parquet_bytes(_relabel(real_batch, 0, 0)))
    leases.commit_batch(1, to_parquet_bytes(_relabel(real_batch, 1, 0)))  # 1 version old
    leases.commit_batch(2, to_parquet_bytes(empty))
    leases.commit_batch(3, to_parquet_bytes(_relabel(real_batch, 3, 2)))
    state = Trainer(run, log=lambda m: None, fused=False).train()
    assert (state.step, state.next_batch) == (3, 4)
    assert (state.dropped, state.dropped_stale, state.dropped_empty) == (1, 0, 1)
    assert state.quarantined == 0
    dropped = run.read_metrics("dropped")
    assert [(r["index"], r["reason"]) for r in dropped] == [(2, "empty")]
    train = sorted(run.read_metrics("train"), key=lambda r: r["step"])
    assert [r["batch_index"] for r in train] == [0, 1, 3]
    assert [r["staleness"] for r in train] == [0, 1, 0]
    assert train[-1]["staleness_hist"] == {"0": 2, "1": 1}
    assert train[-1]["dropped_total"] == 1 and train[-1]["dropped_stale"] == 0
    for name in ("is_ratio_mean", "is_ratio_max", "clip_frac", "logprob_absdiff_max"):
        assert name in train[-1]
    done = json.loads(run.store.read(DONE_KEY))
    assert done["dropped"] == 1 and done["dropped_stale"] == 0 and done["dropped_empty"] == 1


# --------------------------------------------------------------------------------------
# DAPO dynamic sampling and overlong shaping (rollout side)
# --------------------------------------------------------------------------------------


@pytest.fixture
def dapo_worker(worker, monkeypatch):
    """The same worker (and compiled sampler) running the DAPO preset."""
    monkeypatch.setattr(worker, "cfg", with_trainer(worker.cfg, algorithm="dapo"))
    return worker


def test_dapo_dynamic_sampling_never_yields_a_constant_group(dapo_worker):
    cfg = dapo_worker.cfg
    g, p = cfg.rollout.group_size, cfg.rollout.prompts_per_batch
    rounds = cfg.trainer.dynamic_sampling_rounds
    cache = cfg.trainer.overlong_cache(cfg.sampler.max_new_tokens)
    assert cache > 0
    worker = dapo_worker
    problems = {q.problem_id: q for q in worker.problems}
    dropped_somewhere = False
    for index in range(2):
        batch = worker.generate_batch(index, 0)
        stats = dict(worker.last_stats)
        n_groups = len(batch) // g
        assert len(batch) % g == 0 and 0 < n_groups <= p
        assert np.all(L.filter_constant_groups(batch.reward, g))  # no constant group
        slots = batch.prompt_pos.reshape(n_groups, g)
        assert np.all(slots == slots[:, :1]) and np.all(np.diff(slots[:, 0]) > 0)
        assert slots.max() < rounds * p
        assert stats["ds_kept"] == n_groups
        dropped_somewhere |= stats["ds_candidates"] > n_groups
        # Rewards = verifier + DAPO's soft overlong penalty (by completion length).
        for i in range(len(batch)):
            q = problems[batch.prompt_id[i]]
            want = get_task(q.task).verify(q, batch.completion[i]) + L.overlong_penalty(
                np.array([len(batch.completion_ids[i])]), cfg.sampler.max_new_tokens, cache
            )
            assert batch.reward[i] == pytest.approx(float(want[0]), abs=1e-6)
    assert dropped_somewhere  # the base model does produce all-wrong / all-right groups
    # Deterministic: the batch depends on nothing but (seed, index, slot, sample, version).
    again = worker.generate_batch(1, 0)
    assert again.completion_ids == batch.completion_ids
    np.testing.assert_array_equal(again.reward, batch.reward)


def test_dapo_bound_gives_an_empty_batch_when_every_group_is_constant(dapo_worker, monkeypatch):
    cfg = with_trainer(dapo_worker.cfg, overlong_buffer=0, dynamic_sampling_rounds=2)

    from pipeline.tasks.base import Task

    class AlwaysWrong(Task):
        name = "always_wrong"

        def extract_answer(self, completion):
            return None

        def verify(self, problem, completion):
            return 0.0

    from tpu_jobs.generate import (
        sample_verify as sampling,  # the rollout worker's sample -> decode -> verify loop
    )

    monkeypatch.setattr(sampling, "get_task", lambda name: AlwaysWrong())
    monkeypatch.setattr(dapo_worker, "cfg", cfg)
    worker = dapo_worker
    batch = worker.generate_batch(0, 0)
    assert len(batch) == 0
    ds = {k: v for k, v in worker.last_stats.items() if k.startswith("ds_")}
    assert ds == {"ds_candidates": 8, "ds_kept": 0, "ds_rounds": 2}
    data = to_parquet_bytes(batch)  # commit-able; the trainer drops it (tested above)
    with pytest.raises(ValueError, match="empty"):
        from_parquet_bytes(data)


# --------------------------------------------------------------------------------------
# Integrity: a poisoned batch is quarantined and produced again; a non-finite step is
# skipped; neither reaches a published version
# --------------------------------------------------------------------------------------


def _poisoned(batch: RolloutBatch, index: int, how: str) -> RolloutBatch:
    batch = _relabel(batch, index, index)  # max_staleness=0: batch i is made by version i
    if how == "nan reward":
        return replace(batch, reward=np.where(np.arange(len(batch)) == 3, np.nan, batch.reward))
    if how == "inf reward":
        return replace(batch, reward=np.where(np.arange(len(batch)) == 0, np.inf, batch.reward))
    ids = [list(c) for c in batch.completion_ids]
    ids[5][0] = {"token 10^6": 10**6, "token -5": -5}[how]
    return replace(batch, completion_ids=ids)


class _Reproducer:
    """The trainer's log; when it refuses a batch, commit the good one as a worker would."""

    def __init__(self, run, good: dict[int, RolloutBatch], times: int = 1) -> None:
        self.leases = BatchLeases(run.store, ttl_seconds=30)
        self.good, self.times, self.lines = good, times, []

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if line.startswith("[trainer] refused batch "):
            index = int(line.split()[3].rstrip(":"))
            self.times -= 1
            if self.times <= 0:
                self.leases.commit_batch(index, to_parquet_bytes(self.good[index]))


def _published_finite(run) -> list[int]:
    from pipeline.paramserver import ParamServer

    ps = ParamServer(run.store)
    for v in ps.versions():
        for name, x in ps.pull(v).tensors.items():
            assert np.isfinite(x).all(), (v, name)
    return ps.versions()


def test_poisoned_batches_are_quarantined_and_the_run_goes_on(grpo_run, real_batch, tmp_path):
    """The probe's finding 1: a NaN or Inf reward or a token id of 10^6 or -5 in one batch
    made the loss NaN and the next version NaN. Now each is refused, moved to quarantine/
    with its reason, produced again, and the run ends with finite weights."""
    run = clone_run(grpo_run, str(tmp_path / "run"), with_trainer(grpo_run.config, steps=4))
    leases = BatchLeases(run.store, ttl_seconds=30)
    hows = ["nan reward", "inf reward", "token 10^6", "token -5"]
    good = {i: _relabel(real_batch, i, i) for i in range(4)}
    for i, how in enumerate(hows):
        leases.commit_batch(i, to_parquet_bytes(_poisoned(real_batch, i, how)))
    log = _Reproducer(run, good)
    state = Trainer(run, log=log, fused=False).train()
    assert (state.step, state.next_batch, state.quarantined) == (4, 4, 4)
    records = leases.quarantined()
    assert [r["batch_index"] for r in records] == [0, 1, 2, 3]
    reasons = [r["reason"] for r in records]
    assert reasons[0].startswith("row 3: reward is nan")
    assert reasons[1].startswith("row 0: reward is inf")
    assert "token id 1000000" in reasons[2] and "token id -5" in reasons[3]
    # the quarantined copies are the refused bytes; the batches trained on are the good ones
    bad0 = from_parquet_bytes(run.store.read(records[0]["key"].replace(".json", ".parquet")))
    assert np.isnan(bad0.reward[3])
    assert _published_finite(run) == [0, 1, 2, 3, 4]
    train = sorted(run.read_metrics("train"), key=lambda r: r["step"])
    assert [r["batch_index"] for r in train] == [0, 1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in train)
    assert train[-1]["quarantined_total"] == 4


def _final_weights(run) -> dict[str, np.ndarray]:
    from pipeline.paramserver import ParamServer

    ps = ParamServer(run.store)
    return ps.pull(ps.versions()[-1]).tensors


def test_a_batch_of_the_wrong_version_is_quarantined_and_the_run_ends_bit_identical(
    grpo_run, real_batch, tmp_path
):
    """Issue 35, item 5: a batch whose policy_version was published but is not the one the
    schedule pins it to (batch 2 from v0 where max_staleness=0 requires v2) used to pass
    the range check and be dropped as stale: the run then trained on one batch fewer and
    its weights differed from a clean run's. Now it is quarantined and produced again, and
    the run ends with exactly the clean run's weights."""
    cfg = with_trainer(grpo_run.config, steps=3)
    good = {i: _relabel(real_batch, i, i) for i in range(3)}  # required_version(i) = i
    clean = clone_run(grpo_run, str(tmp_path / "clean"), cfg)
    planted = clone_run(grpo_run, str(tmp_path / "planted"), cfg)
    for i in range(3):
        BatchLeases(clean.store, ttl_seconds=30).commit_batch(i, to_parquet_bytes(good[i]))
        batch = _relabel(real_batch, i, 0) if i == 2 else good[i]
        BatchLeases(planted.store, ttl_seconds=30).commit_batch(i, to_parquet_bytes(batch))
    Trainer(clean, log=lambda m: None, fused=False).train()
    state = Trainer(planted, log=_Reproducer(planted, good), fused=False).train()
    assert (state.step, state.next_batch, state.quarantined, state.dropped) == (3, 3, 1, 0)
    [record] = BatchLeases(planted.store, ttl_seconds=30).quarantined()
    assert record["batch_index"] == 2
    assert record["reason"].startswith("policy_version is 0; batch 2 is made from version 2")
    want, got = _final_weights(clean), _final_weights(planted)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_batch_refused_again_and_again_stops_the_trainer_with_a_clear_error(
    grpo_run, real_batch, tmp_path
):
    from tpu_jobs.trainer import IntegrityError

    run = clone_run(grpo_run, str(tmp_path / "run"))
    leases = BatchLeases(run.store, ttl_seconds=30)
    bad = to_parquet_bytes(_poisoned(real_batch, 0, "nan reward"))
    leases.commit_batch(0, bad)

    def log(line: str) -> None:  # a broken worker: the same bad batch every time
        if line.startswith("[trainer] refused batch 0"):
            leases.commit_batch(0, bad)

    with pytest.raises(IntegrityError, match="3 refused batches or non-finite steps in a row"):
        Trainer(run, log=log, fused=False).train()
    assert len(leases.quarantined(0)) == 3
    assert _published_finite(run) == [0]  # nothing but the base was published


@pytest.mark.parametrize("path", ["single", "fused", "several updates"])
def test_the_finite_guard_skips_a_non_finite_update_and_keeps_the_state(
    path, grpo_run, trainer, real_batch
):
    """A NaN that gets past the batch checks (here: planted in the step's inputs) makes the
    gradients NaN; the update is skipped inside the program: params and optimizer state
    come back bit for bit, and the step reports it."""
    changes = {"mini_batches": 2, "epochs": 2} if path == "several updates" else {}
    cfg = with_trainer(grpo_run.config, **changes)
    learner = Learner(cfg, trainer.prompt_len, fused=path == "fused")
    params, opt = learner.init_state(trainer._base_params())
    before = jax.tree.map(np.array, (params, opt))
    inputs = learner.inputs(real_batch)
    rows = np.arange(len(inputs.rewards))  # a NaN in each mini-batch: every update is hit
    poisoned = inputs._replace(rewards=np.where(np.isin(rows, [2, rows[-1]]), np.nan, 0.5))
    ref = trainer._base_params()  # GRPO's KL term
    params, opt, metrics = learner.step(params, opt, ref, poisoned)
    assert metrics["nonfinite_updates"] == learner.updates_per_step
    assert not np.isfinite(metrics["grad_norm"])
    after = jax.tree.map(np.array, (params, opt))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    # and a good batch still updates
    params, opt, metrics = learner.step(params, opt, ref, inputs)
    assert metrics["nonfinite_updates"] == 0 and np.isfinite(metrics["loss"])


def test_a_non_finite_step_is_skipped_quarantined_and_never_published(
    grpo_run, real_batch, tmp_path, monkeypatch
):
    """The trainer's side of the guard: a batch that passes the checks (they are switched
    off here) yet gives NaN gradients is not trained on; the step is taken on the batch a
    worker produces again."""
    import tpu_jobs.trainer as T

    monkeypatch.setattr(T, "read_checked", lambda data, limits: from_parquet_bytes(data))
    run = clone_run(grpo_run, str(tmp_path / "run"))
    leases = BatchLeases(run.store, ttl_seconds=30)
    leases.commit_batch(0, to_parquet_bytes(_poisoned(real_batch, 0, "nan reward")))
    leases.commit_batch(1, to_parquet_bytes(_relabel(real_batch, 1, 1)))
    log = _Reproducer(run, {0: _relabel(real_batch, 0, 0)})
    state = Trainer(run, log=log, fused=False).train()
    assert (state.step, state.nonfinite_steps, state.quarantined) == (2, 1, 1)
    assert "non-finite gradients or parameters" in leases.quarantined(0)[0]["reason"]
    assert _published_finite(run) == [0, 1, 2]


@pytest.mark.parametrize("damage", ["flipped shard", "missing version"])
def test_a_version_a_worker_refuses_is_reported_and_rewritten_by_the_trainer(
    damage, grpo_run, worker, tmp_path, monkeypatch
):
    """The probe's finding 5: a corrupted published shard was refused by the worker, which
    then retried forever while the trainer kept asking "is a rollout worker running?";
    LATEST naming a missing version crashed the worker. Now the worker leaves a marker, the
    trainer rewrites its current version from its parameters, and the worker goes on."""
    from pipeline.paramserver import ParamServer

    run = clone_run(grpo_run, str(tmp_path / "run"))
    trainer = Trainer(run, log=lambda m: None, fused=False)
    lines: list[str] = []
    trainer.log = lines.append
    state = trainer.restore_or_init()
    trainer.epoch = trainer.ps.acquire_epoch()
    trainer._publish(state, trainer.epoch)
    original = {k: np.array(v) for k, v in trainer.ps.pull(0).tensors.items()}
    weights = tmp_path / "run" / "weights" / "v00000000"
    if damage == "flipped shard":
        shard = max(weights.glob("*.bin"), key=lambda p: p.stat().st_size)
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        (weights / "manifest.json").unlink()  # LATEST still names v0
    monkeypatch.setattr(worker, "ps", ParamServer(run.store))
    monkeypatch.setattr(worker, "reader", PolicyReader(worker.ps, base_server(run)))
    monkeypatch.setattr(worker, "version", None)
    assert not worker._ensure_version(0)
    assert list(ParamServer(run.store).refused()) == [0]
    # Backing off: 2 s, doubling with each refusal of the same version, at most 60 s.
    waits = [worker._backoff_s()]
    for _ in range(6):
        assert not worker._ensure_version(0)
        waits.append(worker._backoff_s())
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert worker.ps.report_pending(0, worker.worker_id)
    trainer._heal(state)
    assert not worker.ps.report_pending(0, worker.worker_id)
    t0 = time.monotonic()
    worker._wait_for_repair(0)  # the report is gone: back at once, not after 60 s
    assert time.monotonic() - t0 < 10 * worker.cfg.rollout.poll_seconds + 1.0
    assert "a rollout worker refused it" in lines[-1]
    assert "republished it from the trainer's parameters" in lines[-1]
    assert ParamServer(run.store).refused() == {}
    assert worker._ensure_version(0)
    healed = ParamServer(run.store).pull(0).tensors
    assert_equal = np.testing.assert_array_equal
    for name, x in original.items():
        assert_equal(healed[name], x)


@pytest.mark.parametrize("alg,fused,micro_batch", [("grpo", True, 0), ("ppo", False, 4)])
def test_packed_steps_equal_unpacked_steps(alg, fused, micro_batch, grpo_run, trainer, real_batch):
    """trainer.pack changes the layout, not the step: the same loss, metrics and new
    parameters as the padded rows (the fused step; the shared programs with a value head
    over packed micro-batches)."""
    from tpu_jobs.learning.packing import pack

    out = []
    for packed in (False, True):
        cfg = with_trainer(grpo_run.config, algorithm=alg, pack=packed, micro_batch=micro_batch)
        learner = Learner(cfg, trainer.prompt_len, fused=fused)
        params, opt = learner.init_state(trainer._base_params())
        inputs = learner.inputs(real_batch)
        ref = trainer._base_params() if learner.needs_ref else None
        p, _, m = learner.step(params, opt, ref, inputs)
        out.append((jax.tree.map(np.asarray, p), m))
    rows = pack(inputs.tokens, inputs.mask, learner.completion_len).tokens.shape[0]
    assert rows < learner.rows  # the batch is ragged: packing saves rows
    (pa, ma), (pb, mb) = out
    assert set(ma) == set(mb)
    for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
        if key in ma:
            assert mb[key] == pytest.approx(ma[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_the_publishing_policy_is_the_run_configs():
    """What the trainer hands its Publisher (tests/pipeline/test_publishing.py drives it)."""
    from pipeline.paramserver.publishing import PublishPolicy
    from tests.runs import tiny_config
    from tpu_jobs.trainer import publish_policy

    cfg = tiny_config(
        "paramserver.dtype=sampler",
        "sampler.dtype=bfloat16",
        "paramserver.full_every=3",
        "paramserver.tensor_parts=2",
        "trainer.publish_every=2",
        "trainer.keep_versions=4",
        "trainer.max_staleness=1",
        "rollout.lease_seconds=12",
    )
    want = PublishPolicy(
        dtype="bfloat16",
        parts=2,
        full_every=3,
        publish_every=2,
        keep_versions=4,
        max_staleness=1,
        clock_skew_s=12.0,  # a lease's length, at most 30 s
    )
    assert publish_policy(cfg) == want
    assert publish_policy(tiny_config("rollout.lease_seconds=120")).clock_skew_s == 30.0


# --------------------------------------------------------------------------------------
# On-policy distillation: the Learner's step with the batch's teacher log-probs
# --------------------------------------------------------------------------------------

OPD_PATHS = {
    "single": {},
    "fused": {},
    "several updates": {"mini_batches": 2, "epochs": 2, "micro_batch": 4},
}


def _pi_old(run, learner: Learner, inputs) -> np.ndarray:
    """[R, C] log pi of the sampled tokens under the base model (the params a step starts
    from), from the model directly: not through any trainer program."""
    cfg = run.config
    model = init_model(cfg.model, 0)
    server = base_server(run)
    load_flat_params(model, server.pull(server.latest_version()).tensors)
    logp = sequence_logprobs(
        model,
        jnp.asarray(inputs.tokens),
        jnp.asarray(inputs.mask),
        float(cfg.sampler.temperature),
        first=learner.prompt_len,
    )
    return np.asarray(logp, np.float64)


@pytest.mark.distill
@pytest.mark.parametrize("path", sorted(OPD_PATHS))
def test_an_opd_step_reports_the_reverse_kl_of_its_own_pi_old(path, grpo_run, trainer, real_batch):
    cfg = with_trainer(grpo_run.config, algorithm="opd", **OPD_PATHS[path])
    learner = Learner(cfg, trainer.prompt_len, fused=path == "fused")
    batch = with_teacher(real_batch)
    inputs = learner.inputs(batch)
    comp = np.asarray(inputs.comp_mask, np.float64)
    lt = np.asarray(inputs.logp_teacher, np.float64)
    for i, row in enumerate(batch.teacher_logprobs):  # packed beside the completion
        np.testing.assert_array_equal(lt[i, : len(row)], np.asarray(row, np.float32))
        assert not lt[i, len(row) :].any()
    pi_old = _pi_old(grpo_run, learner, inputs)
    want = float(((pi_old - lt) * comp).sum() / comp.sum())
    params, opt = learner.init_state(trainer._base_params())
    before = jax.tree.map(np.asarray, params)
    params, opt, metrics = learner.step(params, opt, None, inputs)
    _finite(metrics)
    assert metrics["reverse_kl"] == pytest.approx(want, abs=1e-5)
    adv = -(pi_old - lt)[comp > 0]
    assert metrics["adv_mean"] == pytest.approx(adv.mean(), abs=1e-5)
    assert metrics["adv_max"] == pytest.approx(adv.max(), abs=1e-5)
    if path == "several updates":
        assert metrics["updates"] == 4
    changed = jax.tree.map(lambda a, b: bool(np.any(a != np.asarray(b))), before, params)
    assert any(jax.tree.leaves(changed["policy"]))
    missing = dataclasses.replace(real_batch, teacher_logprobs=None)
    with pytest.raises(ValueError, match=r"has no teacher_logprobs; the objective .*'opd'"):
        learner.inputs(missing)


@pytest.mark.distill
@pytest.mark.parametrize("path", ["single", "several updates"])
def test_an_opd_step_at_the_teacher_leaves_the_params_unchanged(
    path, grpo_run, trainer, real_batch
):
    """logp_teacher == logp_old: a zero advantage on every token, so no gradient and (no
    weight decay) no update. pi_old anchored at the sampler's log-probs
    (old_logprobs=behaviour) makes the equality exact."""
    changes = {**OPD_PATHS[path], "old_logprobs": "behaviour"}
    cfg = with_trainer(grpo_run.config, algorithm="opd", **changes)
    assert cfg.trainer.weight_decay == 0.0
    learner = Learner(cfg, trainer.prompt_len, fused=False)
    batch = with_teacher(real_batch, [list(r) for r in real_batch.behaviour_logprobs])
    params, opt = learner.init_state(trainer._base_params())
    before = jax.tree.map(np.array, params)
    params, opt, metrics = learner.step(params, opt, None, learner.inputs(batch))
    assert metrics["reverse_kl"] == 0.0
    assert metrics["adv_max"] == 0.0 and metrics["adv_min"] == 0.0
    assert metrics["grad_norm"] == 0.0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
