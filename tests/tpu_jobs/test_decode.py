"""Decode layouts (tpu_jobs.generate.decode_layouts): the feature-major step equals the model's own
token-major forward on every model variant, and the sampler prepares its weights once
per weight version."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipeline.config import ModelConfig
from pipeline.lora import LoraConfig
from tests.tpu_jobs.random_weights import random_model
from tpu_jobs.generate.decode_layouts import DECODE_LAYOUTS, default_layout
from tpu_jobs.generate.interface import SamplingParams
from tpu_jobs.generate.static_sampler import StaticSampler
from tpu_jobs.model.transformer import (
    flat_params,
    init_cache,
    init_model,
    load_flat_params,
    positions_from_mask,
)

VARIANTS = {
    "llama": ModelConfig(preset="tiny"),
    "qwen2_untied": ModelConfig(preset="tiny", qkv_bias=True, tie_embeddings=False),
    "qwen3": ModelConfig(preset="tiny", qk_norm=True, num_kv_heads=1),
}


def decode_logits(layout: str, model, prompt: np.ndarray, fed: np.ndarray, dtype: str):
    """Prefill `prompt` [B, P] with the model's forward, then feed `fed` [B, N] one token
    at a time through `layout`'s step; returns the N steps' logits [B, N, V]."""
    lay = DECODE_LAYOUTS[layout]
    b, p = prompt.shape
    n = fed.shape[1]

    @jax.jit
    def run(state, prompt, fed):
        m = nnx.merge(graphdef, state)
        cache = init_cache(m.cfg, b, p + n, dtype, per_layer=True)
        mask = jnp.ones_like(prompt)
        _, cache = m(prompt, positions_from_mask(mask), mask, cache, 0, dtype=dtype)
        weights = lay.prepare(m)
        out = []
        for i in range(n):
            pos = jnp.full((b,), p + i, jnp.int32)
            logits, cache = lay.step(m, weights, fed[:, i], pos, cache, jnp.int32(p + i), dtype)
            out.append(logits)
        return jnp.stack(out, axis=1)

    graphdef, state = nnx.split(model)
    return np.asarray(run(state, jnp.asarray(prompt), jnp.asarray(fed)))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_feature_major_step_equals_full_forward(variant):
    cfg = VARIANTS[variant]
    model = random_model(cfg, seed=1, std=0.3)
    rng = np.random.default_rng(0)
    seq = rng.integers(3, cfg.vocab_size, (5, 9)).astype(np.int32)
    prompt, fed = seq[:, :6], seq[:, 6:]
    # Independent reference: one cache-free forward over the whole sequence.
    mask = jnp.ones_like(jnp.asarray(seq))
    full = np.asarray(model(jnp.asarray(seq), positions_from_mask(mask), mask)[0])[:, 6:]
    assert np.abs(full).max() > 1.0
    for layout in DECODE_LAYOUTS:
        got = decode_logits(layout, model, prompt, fed, "float32")
        assert np.abs(got - full).max() <= 1e-4, (layout, np.abs(got - full).max())
    if variant == "qwen2_untied":  # bfloat16 once (the variant with every weight kind)
        fm = decode_logits("feature_major", model, prompt, fed, "bfloat16")
        tm = decode_logits("token_major", model, prompt, fed, "bfloat16")
        err = np.abs(fm - full).max()
        assert 1e-4 < err <= 0.05 * np.abs(full).max()  # really bfloat16, and close
        assert np.abs(fm - tm).max() <= 2 * err


def test_feature_major_serves_lora_adapters_merged():
    """A model with LoRA adapters decodes as its own (unmerged) forward: the feature-major
    weights merge kernel + scale * lora_a @ lora_b (they used to read the kernels alone,
    so a sampler on CPU at hidden >= 256 sampled from the base)."""
    cfg = ModelConfig(preset="tiny")
    model = init_model(cfg, 0, LoraConfig(rank=4, alpha=8.0))
    rng = np.random.default_rng(3)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(jnp.asarray(rng.normal(0, 0.3, var[...].shape), jnp.float32))
    seq = rng.integers(3, cfg.vocab_size, (4, 8)).astype(np.int32)
    mask = jnp.ones_like(jnp.asarray(seq))
    full = np.asarray(model(jnp.asarray(seq), positions_from_mask(mask), mask)[0])[:, 5:]
    base = np.asarray(init_model(cfg, 0)(jnp.asarray(seq), positions_from_mask(mask), mask)[0])
    assert np.abs(full - base[:, 5:]).max() > 1e-2  # the adapters act
    got = decode_logits("feature_major", model, seq[:, :5], seq[:, 5:], "float32")
    assert np.abs(got - full).max() <= 1e-4, np.abs(got - full).max()


def test_default_layout_and_bad_names():
    assert default_layout("cpu", 768) == default_layout("cpu", 256) == "feature_major"
    assert default_layout("cpu", 128) == "token_major"
    assert default_layout("gpu", 768) == default_layout("tpu", 4096) == "token_major"
    big = ModelConfig(preset="100m")
    assert StaticSampler(big).decode_layout == default_layout(jax.default_backend(), 768)
    with pytest.raises(ValueError, match="decode_layout='column'.*'feature_major'"):
        StaticSampler(VARIANTS["llama"], decode_layout="column")


def test_weights_prepared_once_per_weight_version():
    cfg = VARIANTS["qwen2_untied"]
    model = random_model(cfg, seed=2)
    sampler = StaticSampler(cfg, eos_id=-1, decode_layout="feature_major")
    keys = jax.random.split(jax.random.key(0), 2)
    prompts = [[1, 5, 6], [1, 9]]
    a = sampler.generate(model, prompts, keys, SamplingParams(max_new_tokens=6))
    prepared = sampler._prepared[2]
    assert prepared[0] is None  # float32: the state as given, no cast copy
    head = np.asarray(prepared[1]["head"])
    np.testing.assert_array_equal(head, np.asarray(model.lm_head.kernel[...]).T)
    sampler.generate(model, prompts, keys, SamplingParams(max_new_tokens=6))
    assert sampler._prepared[2] is prepared  # same weights: reused
    load_flat_params(model, flat_params(random_model(cfg, seed=3)))  # in place, new arrays
    b = sampler.generate(model, prompts, keys, SamplingParams(max_new_tokens=6))
    assert sampler._prepared[2] is not prepared
    fresh = StaticSampler(cfg, eos_id=-1, decode_layout="feature_major")
    np.testing.assert_array_equal(
        b.tokens, fresh.generate(model, prompts, keys, SamplingParams(max_new_tokens=6)).tokens
    )
    assert not np.array_equal(a.tokens, b.tokens)
    sampler.generate(model, prompts, keys, SamplingParams(max_new_tokens=6, dtype="bfloat16"))
    cast, weights = sampler._prepared[2]  # another dtype: prepared anew, the state cast once
    assert weights["head"].dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype(jnp.bfloat16)}
