"""The transformer against an independent NumPy re-derivation, plus cache/param plumbing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipeline.config import ModelConfig
from tests.tpu_jobs.random_weights import random_model
from tpu_jobs.model.matmul import matmul, matmul_t
from tpu_jobs.model.transformer import (
    flat_params,
    init_cache,
    init_model,
    load_flat_params,
    param_count,
    sequence_logprobs,
)

TINY = ModelConfig(preset="tiny")


def np_forward(flat: dict[str, np.ndarray], cfg: ModelConfig, tokens, mask) -> np.ndarray:
    """Float64 NumPy forward pass written from the HF Llama/Qwen2 definitions."""
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    b, t = tokens.shape
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    f = {k: v.astype(np.float64) for k, v in flat.items()}
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
    ang = pos[..., None] * inv_freq  # [b, t, hd/2]
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]

    def rope(x):  # rotate pairs (i, i + hd/2) by angle pos * inv_freq[i]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def rms(x, w):
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w

    def lin(x, name):
        y = x @ f[name + ".kernel"]
        return y + f[name + ".bias"] if name + ".bias" in f else y

    x = f["embed_tokens.embedding"][tokens]
    allowed = (np.arange(t)[None, :, None] >= np.arange(t)[None, None, :]) & (
        mask[:, None, :] == 1
    )  # [b, i, j]
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        h = rms(x, f[p + "input_layernorm.weight"])
        q = rope(lin(h, p + "self_attn.q_proj").reshape(b, t, nh, hd))
        k = rope(lin(h, p + "self_attn.k_proj").reshape(b, t, nkv, hd))
        v = lin(h, p + "self_attn.v_proj").reshape(b, t, nkv, hd)
        out = np.zeros((b, t, nh, hd))
        for head in range(nh):
            kv = head // (nh // nkv)  # HF repeat_kv
            s = np.einsum("bid,bjd->bij", q[:, :, head], k[:, :, kv]) / np.sqrt(hd)
            s = np.where(allowed, s, -np.inf)
            top = np.max(s, -1, keepdims=True)
            w = np.exp(s - np.where(np.isfinite(top), top, 0.0))
            w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)  # rows without keys: unused
            out[:, :, head] = np.einsum("bij,bjd->bid", w, v[:, :, kv])
        x = x + lin(out.reshape(b, t, nh * hd), p + "self_attn.o_proj")
        h = rms(x, f[p + "post_attention_layernorm.weight"])
        gate = lin(h, p + "mlp.gate_proj")
        x = x + lin(gate / (1 + np.exp(-gate)) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms(x, f["norm.weight"])
    if cfg.tie_embeddings:
        return x @ f["embed_tokens.embedding"].T
    return x @ f["lm_head.kernel"]


def _batch(rng, b, t, vocab):
    """Rows with left padding, right padding, and both."""
    tokens = rng.integers(3, vocab, size=(b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[1, :3] = 0  # left padded
    mask[2, -4:] = 0  # right padded
    mask[3, :2] = 0
    mask[3, -2:] = 0
    return np.where(mask == 1, tokens, 0), mask


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # GQA 4 heads / 2 kv, tied
        dict(qkv_bias=True, tie_embeddings=False),  # Qwen2-like, untied
        dict(num_kv_heads=1, qkv_bias=True),  # multi-query
        dict(num_kv_heads=4, tie_embeddings=False, rope_theta=500.0),  # plain MHA
    ],
)
def test_matches_numpy_reference(overrides):
    cfg = dataclasses.replace(TINY, **overrides)
    model = random_model(cfg, seed=1)
    tokens, mask = _batch(np.random.default_rng(0), 4, 12, cfg.vocab_size)
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    logits, cache = model(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))
    assert cache is None and logits.dtype == jnp.float32
    assert logits.shape == (4, 12, cfg.vocab_size)
    ref = np_forward(flat_params(model), cfg, tokens, mask)
    real = mask == 1
    assert np.std(ref[real]) > 0.5  # logits are not trivially small
    np.testing.assert_allclose(np.asarray(logits)[real], ref[real], atol=1e-4, rtol=0)


def test_causal_and_masked_keys_ignored():
    model = random_model(TINY, seed=2)
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, 64, size=(1, 10)).astype(np.int32)
    mask = np.ones_like(tokens)
    pos = np.arange(10)[None]

    def run(tok, m=mask):
        return np.asarray(model(jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(m))[0])

    base = run(tokens)
    for t in (3, 7, 9):
        changed = tokens.copy()
        changed[0, t] = (changed[0, t] + 5) % 64
        out = run(changed)
        np.testing.assert_allclose(out[0, :t], base[0, :t], atol=1e-6, rtol=0)
        assert np.abs(out[0, t:] - base[0, t:]).max() > 1e-3
    # A masked key is invisible: changing its token changes nothing at the other positions.
    m = mask.copy()
    m[0, 4] = 0
    a = run(tokens, m)
    changed = tokens.copy()
    changed[0, 4] = (changed[0, 4] + 9) % 64
    b = run(changed, m)
    keep = np.arange(10) != 4
    np.testing.assert_allclose(a[0, keep], b[0, keep], atol=1e-6, rtol=0)


@pytest.mark.parametrize("overrides", [dict(), dict(qkv_bias=True, tie_embeddings=False)])
def test_kv_cache_decoding_matches_full_forward(overrides):
    cfg = dataclasses.replace(TINY, **overrides)
    model = random_model(cfg, seed=3)
    rng = np.random.default_rng(2)
    lengths = [5, 2, 7]  # prompt lengths; rows are left padded to p = 7
    p, steps = 7, 6
    tokens = rng.integers(3, 64, size=(3, p + steps)).astype(np.int32)
    mask = np.ones_like(tokens)
    for r, n in enumerate(lengths):
        mask[r, : p - n] = 0
        tokens[r, : p - n] = 0
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    full, _ = model(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))

    cache = init_cache(cfg, 3, p + steps + 3)  # longer than needed: extra slots stay hidden
    # Stale keys/values from an earlier use of the buffer must stay invisible.
    cache = dataclasses.replace(
        cache, k=cache.k + 3.0, v=jnp.asarray(rng.standard_normal(cache.v.shape), jnp.float32)
    )
    logits, cache = model(
        jnp.asarray(tokens[:, :p]), jnp.asarray(pos[:, :p]), jnp.asarray(mask[:, :p]), cache, 0
    )
    got = [np.asarray(logits)]
    for s in range(steps):
        sl = slice(p + s, p + s + 1)
        logits, cache = model(
            jnp.asarray(tokens[:, sl]),
            jnp.asarray(pos[:, sl]),
            jnp.asarray(mask[:, sl]),
            cache,
            jnp.int32(p + s),
        )
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    real = mask == 1
    assert np.abs(got[real] - np.asarray(full)[real]).max() <= 1e-5
    assert cache.k.shape == (cfg.num_layers, 3, p + steps + 3, cfg.num_kv_heads, cfg.head_dim)
    np.testing.assert_array_equal(np.asarray(cache.mask)[:, : p + steps], mask)
    assert np.asarray(cache.mask)[:, p + steps :].sum() == 0


def test_sequence_logprobs_values_jit_and_grad():
    cfg = dataclasses.replace(TINY, tie_embeddings=False)
    model = random_model(cfg, seed=4)
    tokens, mask = _batch(np.random.default_rng(3), 4, 9, cfg.vocab_size)
    flat = flat_params(model)
    ref_logits = np_forward(flat, cfg, tokens, mask)
    for temp in (1.0, 0.7, 0.0):
        out = np.asarray(sequence_logprobs(model, jnp.asarray(tokens), jnp.asarray(mask), temp))
        scaled = ref_logits / (temp if temp > 0 else 1.0)
        logp = (
            scaled
            - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - scaled.max(-1, keepdims=True)
        )
        ref = np.zeros(tokens.shape)
        for b in range(4):
            for t in range(1, 9):
                ref[b, t] = logp[b, t - 1, tokens[b, t]] if mask[b, t] else 0.0
        # positions whose predecessor is a pad (the first real token) come from a query
        # that sees no key; those are excluded from the reference comparison.
        prev_real = np.concatenate([np.zeros((4, 1), bool), mask[:, :-1] == 1], 1)
        np.testing.assert_allclose(out[prev_real], ref[prev_real], atol=1e-4, rtol=0)
        assert np.all(out[:, 0] == 0) and np.all(out[mask == 0] == 0)

    graphdef, params = nnx.split(model)

    @jax.jit
    def loss(params, tokens, mask):
        return -jnp.sum(sequence_logprobs(nnx.merge(graphdef, params), tokens, mask, 0.8))

    grads = jax.grad(loss)(params, jnp.asarray(tokens), jnp.asarray(mask))
    leaves = jax.tree.leaves(grads)
    assert all(np.all(np.isfinite(g)) for g in leaves)
    assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0
    # Directional derivative against a central finite difference.
    direction = jax.tree.map(
        lambda g: jnp.asarray(np.random.default_rng(5).standard_normal(g.shape), jnp.float32),
        grads,
    )
    eps = 1e-3
    plus = jax.tree.map(lambda p, d: p + eps * d, params, direction)
    minus = jax.tree.map(lambda p, d: p - eps * d, params, direction)
    fd = (loss(plus, tokens, mask) - loss(minus, tokens, mask)) / (2 * eps)
    analytic = sum(
        float(jnp.vdot(g, d)) for g, d in zip(leaves, jax.tree.leaves(direction), strict=True)
    )
    assert abs(float(fd) - analytic) <= 2e-2 * max(1.0, abs(analytic))


def test_flat_params_round_trip_and_errors():
    cfg = dataclasses.replace(TINY, qkv_bias=True, tie_embeddings=False)
    src = random_model(cfg, seed=6)
    dst = init_model(cfg, 7)
    flat = flat_params(src)
    assert "lm_head.kernel" in flat and "layers.1.self_attn.q_proj.bias" in flat
    assert flat["layers.0.self_attn.k_proj.kernel"].shape == (32, 16)  # [in, out]
    assert all(v.dtype == np.float32 for v in flat.values())
    load_flat_params(dst, flat)
    back = flat_params(dst)
    assert back.keys() == flat.keys()
    assert all(np.array_equal(back[k], flat[k]) for k in flat)
    tok = jnp.asarray([[1, 5, 9, 4]])
    pos, m = jnp.arange(4)[None], jnp.ones((1, 4), jnp.int32)
    np.testing.assert_array_equal(np.asarray(src(tok, pos, m)[0]), np.asarray(dst(tok, pos, m)[0]))

    bad = dict(flat)
    bad["layers.0.mlp.up_proj.kernel"] = np.zeros((64, 32), np.float32)
    with pytest.raises(
        ValueError,
        match=r"mis-shaped: layers\.0\.mlp\.up_proj\.kernel: got \(64, 32\), expected \(32, 64\)",
    ):
        load_flat_params(dst, bad)
    bad = dict(flat)
    del bad["norm.weight"]
    bad["model.norm.weight"] = flat["norm.weight"]
    with pytest.raises(ValueError, match=r"missing: norm\.weight.*unexpected: model\.norm\.weight"):
        load_flat_params(dst, bad)
    # the failed loads left the model untouched
    assert all(np.array_equal(v, flat[k]) for k, v in flat_params(dst).items())
    # a tied model has no lm_head
    assert "lm_head.kernel" not in flat_params(init_model(TINY, 0))


def test_init_is_deterministic_and_sensible():
    a, b, c = (
        flat_params(init_model(TINY, 3)),
        flat_params(init_model(TINY, 3)),
        flat_params(init_model(TINY, 4)),
    )
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["embed_tokens.embedding"], c["embed_tokens.embedding"])
    assert np.all(a["norm.weight"] == 1.0)
    assert abs(a["embed_tokens.embedding"].std() - 0.02) < 0.005
    assert a["layers.0.self_attn.o_proj.kernel"].std() < a["layers.0.self_attn.q_proj.kernel"].std()


@pytest.mark.parametrize(
    "cfg",
    [
        TINY,
        ModelConfig(preset="tiny", qkv_bias=True, tie_embeddings=False, vocab_size=100),
        ModelConfig(preset="demo"),
        ModelConfig(preset="100m", tie_embeddings=False, qkv_bias=True),
    ],
)
def test_param_count(cfg):
    abstract = nnx.eval_shape(lambda: init_model(cfg, 0))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert param_count(cfg) == n


def test_bfloat16_compute_close_to_float32():
    cfg = ModelConfig(preset="tiny", dtype="bfloat16")
    model = random_model(cfg, seed=8, std=0.1)
    tokens, mask = _batch(np.random.default_rng(4), 4, 8, cfg.vocab_size)
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    args = (jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))
    lo, _ = model(*args)
    hi, _ = model(*args, dtype="float32")
    assert lo.dtype == jnp.float32
    assert all(v.dtype == np.float32 for v in flat_params(model).values())
    real = mask == 1
    err = np.abs(np.asarray(lo) - np.asarray(hi))[real].max()
    assert 0 < err < 0.1 * np.abs(np.asarray(hi)[real]).max()


def test_matmul_accumulates_in_float32_and_keeps_the_operands_dtype():
    """float32 operands: the plain dot, bit for bit. bfloat16 operands: the float32
    product of the bfloat16 values (NumPy), rounded once to bfloat16 (or kept float32 when
    asked): the fast XLA:CPU kernel, and no bfloat16 rounding inside the sum."""
    rng = np.random.default_rng(0)
    a32 = rng.standard_normal((5, 96), np.float32)
    b32 = rng.standard_normal((96, 7), np.float32)
    out = matmul(jnp.asarray(a32), jnp.asarray(b32))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, jnp.asarray(a32) @ jnp.asarray(b32))
    a, b = jnp.asarray(a32, jnp.bfloat16), jnp.asarray(b32, jnp.bfloat16)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)  # exact sums of the bf16 values
    wide = matmul(a, b, jnp.float32)
    assert wide.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(wide), ref, rtol=1e-5, atol=1e-5)
    low = matmul(a, b)
    assert low.dtype == jnp.bfloat16
    # One rounding to bfloat16 (8 bits of mantissa): within half a unit of the last place.
    np.testing.assert_allclose(np.asarray(low, np.float64), ref, rtol=2**-8, atol=1e-6)
    # a @ b.T without the transpose: the same sums.
    bt = jnp.asarray(b32.T.copy(), jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(matmul_t(a, bt, jnp.float32)), ref, rtol=1e-5, atol=1e-5)
    assert matmul_t(a, bt).dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(matmul_t(jnp.asarray(a32), jnp.asarray(b32.T.copy()))),
        a32 @ b32,
        rtol=1e-5,
        atol=1e-5,
    )
