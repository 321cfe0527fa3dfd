"""Numerical alignment of the sampler and the trainer.

The rollout worker stores the sampler's log-probs of the sampled tokens; the trainer
recomputes them with a full forward pass. In float32 the two agree to float32 rounding
noise, and the trainer's own ratio pi_theta / pi_old (pi_old = its recomputation) is
exactly 1 on-policy. With a bfloat16 sampler they drift apart; anchoring the ratio at the
sampler's log-probs then turns the drift into spurious ratios != 1 (and clipping), while
the recomputed anchor keeps the ratio at 1 and moves the mismatch into the (truncated)
importance weight pi_old / pi_behaviour.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pipeline.run import base_server
from pipeline.weight_codec import cast_for_publish
from tests.runs import clone_run
from tpu_jobs.generate.registry import make_sampler
from tpu_jobs.learning.step import Learner
from tpu_jobs.model.transformer import load_flat_params
from tpu_jobs.rollout_worker import RolloutWorker
from tpu_jobs.trainer import Trainer


def _with(cfg, section, **changes):
    return replace(cfg, **{section: replace(getattr(cfg, section), **changes)})


def _with_trainer(cfg, **changes):
    """Trainer fields and loss hyper-parameters (added to the preset's overrides)."""
    return replace(cfg, trainer=cfg.trainer.replace(**changes))


@pytest.fixture(scope="module")
def setup(tiny_base, tmp_path_factory):
    """The base model's batch 0 sampled in float32 and in bfloat16, and a trainer."""
    cfg = _with_trainer(tiny_base.config, algorithm="grpo", kl_coef=0.0)
    run = clone_run(tiny_base, str(tmp_path_factory.mktemp("align") / "run"), cfg)
    trainer = Trainer(run, log=lambda m: None, fused=False)
    worker = RolloutWorker(run, "w0", log=lambda m: None)
    load_flat_params(worker.model, base_server(run).pull(0).tensors)
    batches = {}
    for dtype in ("float32", "bfloat16"):
        worker.cfg = _with(cfg, "sampler", dtype=dtype)
        batches[dtype] = worker.generate_batch(0, 0)
    # The same bf16 batch from the static reference sampler (sampler.engine=static), whose
    # bf16 decode rounds differently from the engine's (see the GSPO test below).
    engine = worker.sampler
    worker.cfg = _with(_with(cfg, "sampler", dtype="bfloat16"), "sampler", engine="static")
    worker.sampler = make_sampler(worker.cfg, worker.tok, worker.mesh)
    batches["bfloat16 static"] = worker.generate_batch(0, 0)
    worker.cfg, worker.sampler = cfg, engine
    # The same base as a version published in bfloat16 (paramserver.dtype), as a worker
    # loads it (load_flat_params casts back to float32), sampled both ways.
    flat = base_server(run).pull(0).tensors
    load_flat_params(worker.model, cast_for_publish(flat, "bfloat16"))
    for dtype in ("float32", "bfloat16"):
        worker.cfg = _with(cfg, "sampler", dtype=dtype)
        batches[f"bf16 weights, {dtype}"] = worker.generate_batch(0, 0)
    return trainer, batches


def _step(trainer, batch, **changes):
    cfg = _with_trainer(trainer.cfg, **changes)
    learner = Learner(cfg, trainer.prompt_len, fused=False)  # shared compiled programs
    params, opt = learner.init_state(trainer._base_params())
    inputs = learner.inputs(batch)
    logp = np.asarray(learner.programs.forward(params, inputs.tokens, inputs.mask)[0])
    _, _, metrics = learner.step(params, opt, None, inputs)
    return inputs, logp, metrics


def test_float32_on_policy_ratio_is_one(setup):
    trainer, batches = setup
    inputs, logp, m = _step(trainer, batches["float32"])
    real = inputs.comp_mask > 0
    ratio = np.exp(logp - inputs.logp_behaviour)[real]
    # The importance ratio pi_trainer / pi_sampler of the real sampler's tokens: 1 within
    # 1e-6 on average, and per token within float32 kernel-order noise (decode with a KV
    # cache vs one full forward; measured max ~1e-5 on this model).
    assert abs(ratio.mean() - 1.0) < 1e-6
    assert np.abs(ratio - 1.0).max() < 1e-4
    assert m["logprob_absdiff_mean"] < 1e-6
    assert abs(m["is_ratio_mean"] - 1.0) < 1e-6
    # The trainer's own ratio pi_theta / pi_old: exactly 1 on every token.
    assert m["ratio_mean"] == m["ratio_max"] == m["ratio_min"] == 1.0
    assert m["clip_frac"] == 0.0 and m["approx_kl"] == 0.0


def test_bfloat16_sampler_drift_and_the_recomputed_anchor(setup):
    trainer, batches = setup
    # Same tokens scored three ways: bf16 sampler drift, ratios anchored at the sampler's
    # log-probs, ratios anchored at the trainer's recomputation (+ TIS).
    inputs, logp, behaviour = _step(
        trainer, batches["bfloat16"], old_logprobs="behaviour", clip_eps=0.2
    )
    _, _, recompute = _step(trainer, batches["bfloat16"], is_correction="tis", is_cap=2.0)
    real = inputs.comp_mask > 0
    drift = np.abs(logp - inputs.logp_behaviour)[real]
    assert drift.max() > 1e-3  # bf16 sampling is visibly off
    assert drift.mean() > 30 * 1e-6  # far above the float32 agreement above
    # The logged max comes from the step's program, `logp` from a separate forward: their
    # log-probs (magnitude ~5) agree to a few float32 ulps (~1e-6), not to 1e-5 of 0.1.
    assert behaviour["logprob_absdiff_max"] == pytest.approx(drift.max(), abs=1e-5)
    # Anchored at the sampler: the "on-policy" ratio is not 1.
    assert behaviour["ratio_max"] > 1.0 + 1e-3 and behaviour["ratio_min"] < 1.0 - 1e-3
    # Anchored at the recomputation: exactly 1, nothing clipped; the mismatch is in the
    # IS weight, which is logged.
    assert recompute["ratio_mean"] == recompute["ratio_max"] == recompute["ratio_min"] == 1.0
    assert recompute["clip_frac"] == 0.0
    assert recompute["is_ratio_max"] > 1.0 + 1e-3
    assert recompute["is_weight_mean"] == pytest.approx(behaviour["is_ratio_mean"], abs=0.05)


def test_bfloat16_published_weights(setup):
    """Versions published in bfloat16: with a bfloat16 sampler nothing changes (the sampler
    rounds its float32 weights to bfloat16 itself, to nearest even like ml_dtypes), so the
    batch is bit-identical; with a float32 sampler the rounded weights are a mismatch of
    their own against the trainer's float32 master weights, which the recomputed anchor
    absorbs exactly as it absorbs bfloat16 sampling."""
    trainer, batches = setup
    same, bf16 = batches["bf16 weights, bfloat16"], batches["bfloat16"]
    assert same.completion_ids == bf16.completion_ids
    assert same.behaviour_logprobs == bf16.behaviour_logprobs
    assert np.array_equal(same.reward, bf16.reward)

    inputs, logp, m = _step(trainer, batches["bf16 weights, float32"], is_correction="tis")
    real = inputs.comp_mask > 0
    drift = np.abs(logp - inputs.logp_behaviour)[real]
    assert drift.mean() > 30 * 1e-6  # far above the float32 agreement (< 1e-6)
    assert m["ratio_mean"] == m["ratio_max"] == m["ratio_min"] == 1.0  # anchor: recomputed
    assert m["clip_frac"] == 0.0 and m["is_ratio_max"] > 1.0 + 1e-4


def _planted_rewards(batch, group_size):
    """The batch with rewards 1, 0, 1, 0, ... in every group: every sequence gets a
    non-zero advantage of a known sign. The tiny base's own rewards are mostly 0, and
    which groups happen to have a success depends on the sampled tokens, i.e. on the
    CPU's float rounding; with all-zero advantages nothing can be clipped anywhere."""
    reward = np.tile(np.arange(group_size) % 2 == 0, len(batch) // group_size)
    return replace(batch, reward=reward.astype(np.float32))


def _rewards_by_drift(batch, seq_drift, group_size):
    """The batch with reward 1 for the upper half of each group by sequence drift and 0 for
    the lower half: every advantage is non-zero and points the way of its sequence's drift
    relative to its group, so the batch's largest |drift| (the top or bottom of its group)
    has an advantage of its own sign, the side on which GSPO clips it."""
    rank = np.argsort(np.argsort(seq_drift.reshape(-1, group_size), -1), -1).reshape(-1)
    return replace(batch, reward=(rank >= group_size // 2).astype(np.float32))


def _sequence_drift(inputs, logp):
    """Per sequence: the mean over its completion tokens of trainer minus sampler log-prob
    (GSPO's log sequence ratio at the first step)."""
    real = inputs.comp_mask > 0
    return np.where(real, logp - inputs.logp_behaviour, 0.0).sum(-1) / np.maximum(real.sum(-1), 1)


# GSPO's clip range on the sequence ratio (the gspo preset: 3e-4 below, 4e-4 above).
GSPO_LOW, GSPO_HIGH = 3e-4, 4e-4
# bfloat16's unit roundoff: 8 significant bits, so a rounding moves a value by up to 2^-9
# of itself.
BF16_U = 2.0**-9


def test_tiny_clip_ranges_are_swamped_by_bf16_drift(setup):
    """GSPO's 3e-4 / 4e-4 clip range is below the bf16 drift: anchored at the sampler,
    sequences are clipped before any update; anchored at the recomputation, none are.

    Why it holds on any CPU: every expectation is derived from the drift this test measures
    (trainer minus sampler, per sequence) or from bf16's precision, not from a share seen
    on one machine (which sequences leave the range, and so the clip fraction, depends on
    the CPU's kernels: 0.375 to 0.875 of them left 4e-4 under four ISA caps of one
    machine).
    - The clip fraction is exactly the share of tokens in sequences whose mean drift leaves
      the clip range on the side of their advantage (computed here from the drift).
    - Rewards are planted by drift rank within each group, so the sequence with the largest
      |drift| has an advantage of its drift's sign: it is clipped as soon as its drift
      leaves the range, and then the clip fraction is > 0.
    - That it leaves the range follows from bf16's precision: the sampler's per-token
      log-probs are off by about the unit roundoff u = 2^-9 ~ 2e-3 (checked below on the
      mean per-token drift), five times the 4e-4 bound, and the largest of a batch's 16
      sequence means keeps a good part of that (measured 1.1-3.0 u, 5-15x the bound, under
      no cap and the AVX2, AVX and SSE4_2 caps of an AMX machine).
    - Anchored at the recomputation the ratio is exactly 1 (nothing clipped), and float32
      sampling agrees with the trainer to ~1e-6 per token, far inside 3e-4."""
    trainer, batches = setup
    g = trainer.cfg.rollout.group_size
    # The static sampler's bf16 batch: its bf16 decode rounds differently from the engine's
    # and drifts more per sequence (a quarter of the engine's sequences left 4e-4, over a
    # third of these).
    raw = batches["bfloat16 static"]
    inputs, logp, _ = _step(trainer, raw, algorithm="gspo", old_logprobs="behaviour")
    real = inputs.comp_mask > 0
    seq_drift = _sequence_drift(inputs, logp)
    token_drift = np.abs(logp - inputs.logp_behaviour)[real]
    # bf16's precision shows: a token's log-prob is off by about u (the activations are
    # rounded to 8 bits at every layer; measured mean 0.85-1.3 u under four ISA caps), and
    # the largest sequence mean is beyond GSPO's upper bound, 0.2 u (measured 1.1-3.0 u).
    assert token_drift.mean() > BF16_U / 8, token_drift.mean()
    assert np.abs(seq_drift).max() > GSPO_HIGH, np.abs(seq_drift).max()

    bf16 = _rewards_by_drift(raw, seq_drift, g)
    inputs, logp, behaviour = _step(trainer, bf16, algorithm="gspo", old_logprobs="behaviour")
    _, _, recompute = _step(trainer, bf16, algorithm="gspo")
    f32 = _planted_rewards(batches["float32"], g)
    _, _, f32m = _step(trainer, f32, algorithm="gspo", old_logprobs="behaviour")

    ratio = np.exp(seq_drift)
    adv_sign = np.sign(inputs.rewards - inputs.rewards.reshape(-1, g).mean(-1).repeat(g))
    low, high = ratio < 1 - GSPO_LOW, ratio > 1 + GSPO_HIGH
    clipped = (low & (adv_sign < 0)) | (high & (adv_sign > 0))
    expected = (real.sum(-1) * clipped).sum() / real.sum()
    # Sequences within float32 noise (1e-6) of a bound may fall either way: allow their share.
    near = (np.abs(ratio - (1 - GSPO_LOW)) < 1e-6) | (np.abs(ratio - (1 + GSPO_HIGH)) < 1e-6)
    assert abs(behaviour["clip_frac"] - expected) <= (real.sum(-1) * near).sum() / real.sum() + 1e-6
    # The largest |drift| is clipped (planted sign, beyond the bound): the fraction is at
    # least its share of the batch's tokens.
    top = np.argmax(np.abs(seq_drift))
    assert clipped[top] and behaviour["clip_frac"] >= real[top].sum() / real.sum() - 1e-6
    assert recompute["clip_frac"] == 0.0
    assert f32m["clip_frac"] == 0.0  # float32 sampling stays inside even that range


def test_bfloat16_trainer_keeps_float32_master_weights(setup):
    """model.dtype=bfloat16 (the trainer's compute dtype): the parameters and AdamW's
    moments stay float32 after a step and change; the on-policy ratio against its own
    recomputation is exactly 1, and the float32 sampler's log-probs differ from the bf16
    trainer's by the bf16 drift, which lands in the logged IS weight, not in the ratio."""
    import jax

    trainer, batches = setup
    cfg = _with(
        _with_trainer(trainer.cfg, is_correction="tis", is_cap=2.0), "model", dtype="bfloat16"
    )
    learner = Learner(cfg, trainer.prompt_len, fused=False)
    params, opt = learner.init_state(trainer._base_params())
    before = jax.tree.map(np.asarray, params)
    params, opt, m = learner.step(params, opt, None, learner.inputs(batches["float32"]))
    leaves = jax.tree.leaves(params) + [
        x for x in jax.tree.leaves(opt) if np.ndim(x) > 0
    ]  # the moments; not the step counters
    assert {str(x.dtype) for x in leaves} == {"float32"}
    changed = jax.tree.map(lambda a, b: bool(np.any(a != np.asarray(b))), before, params)
    assert any(jax.tree.leaves(changed))
    assert m["ratio_mean"] == m["ratio_max"] == m["ratio_min"] == 1.0
    assert m["logprob_absdiff_max"] > 1e-3  # bf16 compute is visibly off float32
    assert m["is_ratio_max"] > 1.0 + 1e-3 or m["is_ratio_min"] < 1.0 - 1e-3
