"""LoRA in the model and the trainer (`pipeline.lora`, `tpu_jobs.model.transformer.Linear`):
the adapted model against the plain model with NumPy-merged kernels, version 0 = the base,
gradients and optimizer state for the adapters only, the KL reference = the base with the
adapters off, a GRPO step that moves only the adapters, every algorithm preset, and a
checkpoint resume that gives bit-identical adapters."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline import config as C
from pipeline.leases import BatchLeases
from pipeline.lora import LoraConfig, adapter_shapes, is_adapter, merge
from pipeline.paramserver.adapters import BASE_DIGEST, LORA_SCALE, PolicyReader
from pipeline.rollouts import to_parquet_bytes
from pipeline.run import Run, base_server, start_adapter_server, weights_server
from tests.runs import clone_run, with_algorithm, with_teacher
from tpu_jobs import rollout_worker as rw
from tpu_jobs.learning.step import Learner
from tpu_jobs.model.state import flat_to_state, split_lora, state_to_flat
from tpu_jobs.model.transformer import (
    flat_params,
    init_model,
    load_flat_params,
    positions_from_mask,
    sequence_logprobs,
)
from tpu_jobs.trainer import Trainer

pytestmark = pytest.mark.lora  # the `lora` lane of .ci/run (make test stays < 12 min)

TINY = C.ModelConfig(preset="tiny")
LORA = LoraConfig(rank=4, alpha=8.0)
EPS32 = float(np.finfo(np.float32).eps)


def _tokens(cfg: C.ModelConfig, rows: int = 2, length: int = 12, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (rows, length)), jnp.int32)
    mask = jnp.ones((rows, length), jnp.int32).at[0, :3].set(0)  # a left-padded row
    return tokens, mask


def _logits(model, tokens, mask):
    return np.asarray(model(tokens, positions_from_mask(mask), mask)[0])


def _random_adapters(adapters, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    flat = state_to_flat(adapters)
    return {k: (0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in flat.items()}


# --------------------------------------------------------------------------- the model


def test_adapters_follow_the_contract_and_leave_the_base_as_it_was():
    fns, adapters, base = split_lora(init_model(TINY, 0, LORA))
    plain = flat_params(init_model(TINY, 0))
    flat_base, flat_adapters = state_to_flat(base), state_to_flat(adapters)
    # The base is the plain model of the same seed, bit for bit (own key stream for A).
    assert sorted(flat_base) == sorted(plain)
    assert all(np.array_equal(flat_base[k], plain[k]) for k in plain)
    # Names and shapes are pipeline.lora's; B starts at zero, A within PEFT's bound.
    shapes = adapter_shapes({k: v.shape for k, v in plain.items()}, LORA)
    assert {k: v.shape for k, v in flat_adapters.items()} == shapes
    for name, value in flat_adapters.items():
        if name.endswith(".lora_b"):
            assert not value.any(), name
        else:
            assert 0 < np.abs(value).max() <= 1 / np.sqrt(value.shape[0]), name


def test_adapted_model_equals_the_plain_model_with_merged_kernels():
    """Logits of base + adapters (unmerged, as the trainer runs it) against the plain model
    holding `pipeline.lora.merge`'s kernels (what the samplers run), in float32."""
    fns, adapters, base = split_lora(init_model(TINY, 0, LORA))
    flat_adapters = _random_adapters(adapters)
    adapted = fns.merge(flat_to_state(adapters, flat_adapters), base)
    merged = init_model(TINY, 0)
    load_flat_params(merged, merge(state_to_flat(base), flat_adapters, LORA.scale))
    tokens, mask = _tokens(TINY)
    got, want = _logits(adapted, tokens, mask), _logits(merged, tokens, mask)
    # The same sums in another order: a few float32 ulps of the logits' scale per layer.
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 64 * EPS32 * scale * TINY.num_layers
    assert np.abs(got - _logits(init_model(TINY, 0), tokens, mask)).max() > 1e-3  # it acts


def test_version_zero_is_the_base():
    """Fresh adapters (B = 0) leave the base's logits exactly (x @ A @ 0 adds zeros), and the
    worker's merge of them gives the base's kernels bit for bit."""
    fns, adapters, base = split_lora(init_model(TINY, 0, LORA))
    tokens, mask = _tokens(TINY)
    plain = init_model(TINY, 0)
    np.testing.assert_array_equal(
        _logits(fns.merge(adapters, base), tokens, mask), _logits(plain, tokens, mask)
    )
    merged = merge(state_to_flat(base), state_to_flat(adapters), LORA.scale)
    assert all(np.array_equal(merged[k], v) for k, v in flat_params(plain).items())


def test_bfloat16_base_is_stored_in_bfloat16_and_adapters_in_float32():
    lora = dataclasses.replace(LORA, base_dtype="bfloat16")
    fns, adapters, base = split_lora(init_model(TINY, 0, lora))
    assert {v.dtype for v in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
    assert {v.dtype for v in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    tokens, mask = _tokens(TINY)
    got = _logits(fns.merge(adapters, base), tokens, mask)
    want = _logits(init_model(TINY, 0), tokens, mask)
    # Only the base's rounding to bfloat16 (8 bits of mantissa) separates them.
    bf16 = float(jnp.finfo(jnp.bfloat16).eps)
    assert np.abs(got - want).max() <= 8 * bf16 * np.abs(want).max()


def test_gradients_exist_for_the_adapters_only():
    fns, adapters, base = split_lora(init_model(TINY, 0, LORA))
    adapters = flat_to_state(adapters, _random_adapters(adapters))
    tokens, mask = _tokens(TINY)

    def loss(a, b):
        return sequence_logprobs(fns.merge(a, b), tokens, mask).sum()

    grads = jax.grad(loss)(adapters, base)
    flat = state_to_flat(grads)
    assert sorted(flat) == sorted(state_to_flat(adapters)) and all(map(is_adapter, flat))
    assert all(np.abs(g).max() > 0 for g in flat.values())
    # Against a central finite difference of one entry of one adapter.
    name = "layers.1.mlp.down_proj.lora_b"
    h, values = 1e-2, state_to_flat(adapters)
    plus, minus = dict(values), dict(values)
    plus[name] = values[name].copy()
    plus[name][0, 0] += h
    minus[name] = values[name].copy()
    minus[name][0, 0] -= h
    fd = (
        loss(flat_to_state(adapters, plus), base) - loss(flat_to_state(adapters, minus), base)
    ) / (2 * h)
    assert float(fd) == pytest.approx(float(flat[name][0, 0]), rel=2e-2, abs=1e-3)


# --------------------------------------------------------------------------- the trainer


def with_lora(cfg: C.RunConfig, **trainer) -> C.RunConfig:
    return replace(cfg, lora=LORA, trainer=replace(cfg.trainer, **trainer))


@pytest.fixture(scope="module")
def lora_run(tiny_base, tmp_path_factory):
    cfg = with_lora(tiny_base.config, algorithm="grpo", steps=2, max_staleness=1)
    cfg = replace(cfg, trainer=replace(cfg.trainer, checkpoint_every=1))
    return clone_run(tiny_base, str(tmp_path_factory.mktemp("lora") / "run"), cfg)


@pytest.fixture(scope="module")
def trainer(lora_run):
    return Trainer(lora_run, log=lambda m: None, fused=False)


@pytest.fixture(scope="module")
def real_batch(lora_run):
    """A batch sampled from version 0 by the real worker (adapters merged into the base),
    with mixed rewards (see tests/tpu_jobs/test_trainer.py's real_batch for why 8 tries)."""
    trainer = Trainer(lora_run, log=lambda m: None, fused=False)
    trainer._publish(trainer.restore_or_init(), trainer.ps.acquire_epoch())  # v0: adapters
    worker = rw.RolloutWorker(lora_run, "w0", log=lambda m: None)
    assert worker._ensure_version(0)
    for index in range(8):
        batch = worker.generate_batch(index, 0)
        if 0.0 < batch.reward.mean() < 1.0:
            return batch
    raise AssertionError("8 batches of the base model, none with mixed rewards")


def test_version_zero_holds_adapters_naming_the_base(lora_run, real_batch):
    ps, base = weights_server(lora_run), base_server(lora_run)
    snap = ps.pull(0)
    assert snap.tensors and all(map(is_adapter, snap.tensors))
    assert snap.metadata[LORA_SCALE] == LORA.scale
    assert snap.metadata[BASE_DIGEST].startswith("sha256:")
    merged = PolicyReader(ps, base).pull(0).tensors
    want = base.pull(base.latest_version()).tensors
    assert sorted(merged) == sorted(want)
    assert all(np.array_equal(merged[k], want[k]) for k in want)  # B = 0: the base's bits


def test_grpo_step_moves_only_the_adapters(lora_run, trainer, real_batch):
    learner = trainer.learner
    frozen = trainer._base_params()
    base_before = state_to_flat(frozen)
    params, opt_state = learner.init_state(learner.new_policy(lora_run.config.seed))
    before = state_to_flat(params["policy"])
    # Optimizer state only for the adapters: its leaves are the adapters' sizes.
    n_adapter = sum(v.size for v in before.values())
    n_opt = sum(np.size(x) for x in jax.tree.leaves(opt_state))
    assert n_opt < 3 * n_adapter + 16  # Adam's mu and nu and a few counters
    inputs = learner.inputs(real_batch)
    params, opt_state, metrics = learner.step(params, opt_state, frozen, inputs, frozen)
    after = state_to_flat(params["policy"])
    assert metrics["grad_norm"] > 0 and np.isfinite(metrics["loss"])
    assert metrics["logprob_absdiff_max"] < 1e-4  # sampler (merged) vs trainer (unmerged)
    assert sorted(after) == sorted(before) and all(map(is_adapter, after))
    assert any(not np.array_equal(after[k], before[k]) for k in after if k.endswith("lora_b"))
    base_after = state_to_flat(frozen)
    assert all(np.array_equal(base_after[k], base_before[k]) for k in base_before)


def test_kl_reference_is_the_base_with_adapters_off(lora_run, trainer, real_batch):
    """The reference log-probs of a LoRA learner (the frozen base through the plain graph)
    are the plain model's with the base's weights; at version 0 the policy's equal them."""
    learner = trainer.learner
    frozen = trainer._base_params()
    inputs = learner.inputs(real_batch)
    tokens, mask = jnp.asarray(inputs.tokens), jnp.asarray(inputs.mask)
    ref = np.asarray(learner.programs.ref_logp(frozen, tokens, mask))
    plain = init_model(lora_run.config.model, 0)
    snap = base_server(lora_run).pull(0)
    load_flat_params(plain, snap.tensors)
    want = np.asarray(sequence_logprobs(plain, tokens, mask, first=learner.prompt_len))
    # Eager vs compiled programs sum in other orders: float32 ulps of the log-probs' scale.
    tol = 64 * EPS32 * max(1.0, np.abs(want).max())
    assert np.abs(ref - want).max() <= tol
    params, _ = learner.init_state(learner.new_policy(lora_run.config.seed))
    logp = learner.programs.forward(params, tokens, mask, None, frozen)[0]
    assert np.abs(np.asarray(logp) - want).max() <= tol
    # The reference of a step is the frozen base itself: a KL preset's first step (policy
    # = base) measures no divergence.
    cfg = replace(lora_run.config, trainer=replace(lora_run.config.trainer, algorithm="grpo"))
    kl = Learner(cfg, trainer.prompt_len, fused=False)
    assert kl.needs_ref
    _, _, metrics = kl.step(params, kl.init_state(params["policy"])[1], frozen, inputs, frozen)
    assert abs(metrics["kl_ref"]) <= tol


@pytest.mark.parametrize("alg", C.ALGORITHMS)
def test_every_algorithm_steps_the_adapters(alg, lora_run, trainer, real_batch):
    cfg = with_algorithm(lora_run.config, alg)
    learner = Learner(cfg, trainer.prompt_len, fused=False)
    frozen = trainer._base_params()
    params, opt_state = learner.init_state(learner.new_policy(cfg.seed))
    before = state_to_flat(params["policy"])
    ref = frozen if learner.needs_ref else None
    batch = with_teacher(real_batch) if learner.spec.needs_teacher else real_batch
    params, _, metrics = learner.step(params, opt_state, ref, learner.inputs(batch), frozen)
    bad = {k: v for k, v in metrics.items() if not np.isfinite(v)}
    assert not bad, bad
    assert metrics["grad_norm"] > 0
    after = state_to_flat(params["policy"])
    assert any(not np.array_equal(after[k], before[k]) for k in after)
    assert ("value" in params) == (alg == "ppo")


def test_checkpoint_resume_gives_bit_identical_adapters(lora_run, real_batch, tmp_path):
    """Two steps straight vs one step, a stop (checkpoint), a new trainer, one more step:
    the final adapter versions are bit-identical; a checkpoint of another base is refused."""
    finals = {}
    for name in ("straight", "resumed"):
        run = clone_run(lora_run, str(tmp_path / name), lora_run.config)
        leases = BatchLeases(run.store, ttl_seconds=30)
        for index in range(2):  # both sampled at v0 (max_staleness=1 keeps batch 1)
            batch = replace(real_batch, batch_index=index)
            leases.commit_batch(index, to_parquet_bytes(batch))
        if name == "resumed":
            first = Trainer(run, log=lambda m: None, fused=False)
            first.log = lambda m, t=first: t.request_stop() if "step 1/" in m else None
            assert first.train().step == 1
        final = Trainer(run, log=lambda m: None, fused=False).train()
        assert final.step == 2
        snap = weights_server(run).pull(2)
        assert all(map(is_adapter, snap.tensors))
        finals[name] = {k: np.array(v) for k, v in snap.tensors.items()}
    a, b = finals["straight"], finals["resumed"]
    assert sorted(a) == sorted(b)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    # Another base under the run: the checkpoint's adapters do not belong to it.
    run = Run.open(str(tmp_path / "resumed"))
    base = base_server(run)
    tensors = {k: np.array(v) for k, v in base.pull(0).tensors.items()}
    tensors["norm.weight"] = tensors["norm.weight"] + 1
    base.publish(1, tensors, epoch=base.acquire_epoch())
    with pytest.raises(Exception, match="holds LoRA adapters of base sha256:"):
        Trainer(run, log=lambda m: None, fused=False).restore_or_init()


# --------------------------------------------------------------------------- dropout


def test_dropout_acts_on_the_adapter_input_in_training_only():
    """A projection with dropout against its formula with the same mask; without a key
    (inference, the samplers' merged weights) it is the plain adapted projection."""
    lora = dataclasses.replace(LORA, dropout=0.25)
    fns, adapters, base = split_lora(init_model(TINY, 0, lora))
    adapters = flat_to_state(adapters, _random_adapters(adapters))
    model = fns.merge(adapters, base)
    proj = model.layers[0].mlp.up_proj
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5, TINY.hidden_size)), jnp.float32)
    key = jax.random.key(9)
    keep = np.asarray(jax.random.bernoulli(key, 0.75, x.shape))
    xk, a, b = np.asarray(x), np.asarray(proj.lora_a[...]), np.asarray(proj.lora_b[...])
    kernel = np.asarray(proj.kernel[...])
    want = xk @ kernel + lora.scale * ((np.where(keep, xk / 0.75, 0.0) @ a) @ b)
    got = np.asarray(proj(x, key))
    assert np.abs(got - want).max() <= 64 * EPS32 * np.abs(want).max()
    plain = xk @ kernel + lora.scale * ((xk @ a) @ b)
    assert np.abs(np.asarray(proj(x)) - plain).max() <= 64 * EPS32 * np.abs(plain).max()
    assert np.abs(got - plain).max() > 1e-3


def test_dropout_masks_are_the_same_with_and_without_the_layer_scan():
    """Layer i's masks come from fold_in(key, i) in the Python loop and in the remat scan."""
    lora = dataclasses.replace(LORA, dropout=0.5)
    tokens, mask = _tokens(TINY)
    key = jax.random.key(4)
    logits = {}
    for remat in ("none", "full"):
        cfg = dataclasses.replace(TINY, remat=remat)
        fns, adapters, base = split_lora(init_model(cfg, 0, lora))
        adapters = flat_to_state(adapters, _random_adapters(adapters))
        logits[remat] = np.asarray(sequence_logprobs(fns.merge(adapters, base, key), tokens, mask))
        no_dropout = np.asarray(sequence_logprobs(fns.merge(adapters, base), tokens, mask))
        assert np.abs(logits[remat] - no_dropout).max() > 1e-4  # the masks act
    scale = max(1.0, np.abs(logits["none"]).max())
    assert np.abs(logits["none"] - logits["full"]).max() <= 256 * EPS32 * scale


def test_a_step_with_dropout_draws_its_masks_from_the_step(lora_run, trainer, real_batch):
    """The same step twice: the same adapters (resumable); another step's masks: others."""
    cfg = replace(lora_run.config, lora=dataclasses.replace(LORA, dropout=0.1))
    learner = Learner(cfg, trainer.prompt_len, fused=False)
    frozen = trainer._base_params()
    inputs = learner.inputs(real_batch)
    out = {}
    for name, step in (("a", 3), ("b", 3), ("c", 4)):
        params, opt = learner.init_state(learner.new_policy(cfg.seed))
        params, _, metrics = learner.step(params, opt, frozen, inputs, frozen, step)
        assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        out[name] = state_to_flat(params["policy"])
    assert all(out["a"][k].tobytes() == out["b"][k].tobytes() for k in out["a"])
    assert any(out["a"][k].tobytes() != out["c"][k].tobytes() for k in out["a"])


def test_the_fused_step_gives_the_unfused_steps_adapters(lora_run, trainer, real_batch):
    """trainer.fused_step (one program) and the chained programs: the same update, up to
    the order of float32 sums (AdamW's first step is ~lr * sign(g) per element, so an
    element whose gradient is ~0 may go either way: compared on average)."""
    frozen = trainer._base_params()
    out = {}
    for fused in (False, True):
        learner = Learner(lora_run.config, trainer.prompt_len, fused=fused)
        assert learner.fused == fused
        params, opt = learner.init_state(learner.new_policy(lora_run.config.seed))
        start = state_to_flat(params["policy"])
        params, _, _ = learner.step(params, opt, frozen, learner.inputs(real_batch), frozen)
        out[fused] = state_to_flat(params["policy"])
    moved = np.mean([np.abs(out[False][k] - start[k]).mean() for k in start])
    apart = np.mean([np.abs(out[True][k] - out[False][k]).mean() for k in start])
    assert moved > 0 and apart <= 1e-2 * moved


def test_an_imported_adapter_is_where_training_starts(lora_run, tmp_path):
    """A PEFT adapter imported into the run (`start_adapter_server` v0, as `rlax import-hf
    --adapter` writes it) is the trainer's step-0 adapters, bit for bit."""
    run = clone_run(lora_run, str(tmp_path / "run"), lora_run.config)
    trainer = Trainer(run, log=lambda m: None, fused=False)
    fresh = state_to_flat(trainer.learner.new_policy(run.config.seed))
    start = _random_adapters(flat_to_state(trainer.learner.new_policy(0), fresh), seed=5)
    server = start_adapter_server(run)
    server.publish(0, start, epoch=server.acquire_epoch())
    got = state_to_flat(trainer.restore_or_init().params["policy"])
    assert sorted(got) == sorted(start)
    assert all(got[k].tobytes() == start[k].tobytes() for k in start)
