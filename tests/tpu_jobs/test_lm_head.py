"""Chunked LM-head log-probs and entropy against NumPy and the dense computation; the
sampler's prefill (LM head at the last prompt position only) against the full forward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipeline.config import ModelConfig
from tpu_jobs.generate.interface import SamplingParams
from tpu_jobs.generate.static_sampler import StaticSampler, prefill
from tpu_jobs.learning.value_head import init_value_head, policy_forward
from tpu_jobs.model.lm_head import token_logprobs
from tpu_jobs.model.transformer import init_cache, positions_from_mask, sequence_logprobs

from .random_weights import random_model

CHUNKS = (0, 1, 5, 16, 1000)  # dense, one token, not a divisor, a divisor, all at once


def np_stats(h, w, targets, temp, vocab_major):
    """NumPy (logp, entropy, d sum(logp + 0.5 entropy) / d logits)."""
    h, w = h.astype(np.float64), w.astype(np.float64)
    z = h @ (w.T if vocab_major else w)
    s = z / (temp if temp > 0 else 1.0)
    s = s - s.max(-1, keepdims=True)
    logp_all = s - np.log(np.exp(s).sum(-1, keepdims=True))
    p = np.exp(logp_all)
    logp = np.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    ent = -(p * logp_all).sum(-1)
    onehot = np.eye(z.shape[-1])[targets]
    # d logp / d s = onehot - p;  d H / d s = -p (log p + H);  s = z / temp.
    ds = (onehot - p) + 0.5 * (-p * (logp_all + ent[..., None]))
    return logp, ent, ds / (temp if temp > 0 else 1.0)


@pytest.mark.parametrize("vocab_major", [True, False])
@pytest.mark.parametrize("temp", [1.0, 0.7, 0.0])
def test_chunked_logprobs_entropy_and_grads_equal_numpy(vocab_major, temp):
    rng = np.random.default_rng(0)
    b, n, hid, vocab = 3, 7, 8, 50
    h = rng.standard_normal((b, n, hid)).astype(np.float32)
    w = rng.standard_normal((vocab, hid) if vocab_major else (hid, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, (b, n)).astype(np.int32)
    ref_logp, ref_ent, dz = np_stats(h, w, targets, temp, vocab_major)
    ref_dh = dz @ (w if vocab_major else w.T)
    ref_dw = np.einsum("bnv,bnh->vh" if vocab_major else "bnv,bnh->hv", dz, h)
    for chunk in CHUNKS:

        def f(h, w, chunk=chunk):
            return token_logprobs(
                h, jnp.asarray(targets), w, vocab_major=vocab_major, temperature=temp,
                chunk=chunk, entropy=True,
            )  # fmt: skip

        logp, ent = jax.jit(f)(h, w)
        np.testing.assert_allclose(np.asarray(logp), ref_logp, atol=2e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=2e-5, rtol=0)

        def loss(h, w, f=f):
            logp, ent = f(h, w)
            return jnp.sum(logp) + 0.5 * jnp.sum(ent)

        dh, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(h, w)
        np.testing.assert_allclose(np.asarray(dh), ref_dh, atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(dw), ref_dw, atol=1e-4, rtol=1e-5)
    logp, ent = token_logprobs(
        jnp.asarray(h), jnp.asarray(targets), jnp.asarray(w), vocab_major=vocab_major, chunk=4
    )
    assert ent is None and logp.shape == (b, n)


def test_chunked_program_holds_no_full_logits():
    """The chunked program's largest vocabulary-wide array is [chunk, V], in the forward
    and the backward pass; the dense one holds [B, N, V]."""
    b, n, hid, vocab, chunk = 4, 64, 8, 1000, 32

    def hlo(chunk):
        def loss(h, w):
            logp, ent = token_logprobs(
                h, jnp.zeros((b, n), jnp.int32), w, vocab_major=True, chunk=chunk, entropy=True
            )
            return jnp.sum(logp) + jnp.sum(ent)

        args = (
            jax.ShapeDtypeStruct((b, n, hid), jnp.float32),
            jax.ShapeDtypeStruct((vocab, hid), jnp.float32),
        )
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()

    assert f"f32[{b},{n},{vocab}]" in hlo(0)
    text = hlo(chunk)
    assert f"{b},{n},{vocab}]" not in text and f"[{b * n},{vocab}]" not in text
    assert f"f32[{chunk},{vocab}]" in text


TINY = ModelConfig(preset="tiny", vocab_size=64, tie_embeddings=False)


def _batch(rng, b, t, vocab):
    tokens = rng.integers(3, vocab, (b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[0, :3] = 0  # left padding
    mask[1, t - 2 :] = 0  # right padding
    return tokens, mask


@pytest.mark.parametrize("tie", [True, False])
def test_model_logprobs_chunked_equal_dense_values_and_grads(tie):
    dense_cfg = dataclasses.replace(TINY, tie_embeddings=tie, logits_chunk=0)
    model = random_model(dense_cfg, seed=1)
    graphdef, params = nnx.split(model)
    tokens, mask = _batch(np.random.default_rng(2), 4, 11, TINY.vocab_size)
    value = init_value_head(TINY.hidden_size)
    value = {"kernel": value["kernel"] + 0.1, "bias": value["bias"] + 0.2}

    def run(chunk):
        # The same weights under a config that differs only in logits_chunk.
        cfg = dataclasses.replace(dense_cfg, logits_chunk=chunk)
        g = nnx.split(random_model(cfg, seed=1))[0]

        def loss(prm, v):
            out = policy_forward(nnx.merge(g, prm), tokens, mask, 0.8, v, entropy=True, first=4)
            return jnp.sum(out.logp) + 0.3 * jnp.sum(out.entropy) + jnp.sum(out.values), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, value)
        return out, grads, sequence_logprobs(nnx.merge(g, params), tokens, mask, 0.8)

    dense_out, dense_grads, dense_lp = run(0)
    # `first` drops leading columns only (under grad vs eager: float rounding apart).
    np.testing.assert_allclose(
        np.asarray(dense_out.logp), np.asarray(dense_lp)[:, 4:], atol=2e-6, rtol=0
    )
    for chunk in (1, 7, 16):
        out, grads, lp = run(chunk)
        for got, want in zip(out, dense_out, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(lp), np.asarray(dense_lp), atol=1e-5, rtol=0)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(dense_grads), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-4)


def test_first_out_of_range_is_refused():
    model = random_model(TINY, seed=0)
    tokens, mask = _batch(np.random.default_rng(0), 2, 6, TINY.vocab_size)
    with pytest.raises(ValueError, match="first=6"):
        sequence_logprobs(model, tokens, mask, first=6)


# --------------------------------------------------------------------------- sampler


def test_prefill_logits_equal_the_full_forward_at_the_last_position():
    cfg = dataclasses.replace(TINY, qkv_bias=True)
    model = random_model(cfg, seed=3)
    tokens, mask = _batch(np.random.default_rng(4), 3, 10, cfg.vocab_size)
    mask[1] = 1  # prompts are left-padded: the last position is real
    full, _ = model(jnp.asarray(tokens), positions_from_mask(mask), jnp.asarray(mask))
    cache = init_cache(cfg, 3, 16, per_layer=True)
    logits, cache = jax.jit(prefill, static_argnums=4)(model, tokens, mask, cache, "float32")
    assert logits.shape == (3, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full)[:, -1], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.mask)[:, :10], mask)


def test_sampled_tokens_for_fixed_keys_equal_a_full_forward_reference():
    """Row r's token at step s is argmax(logits / T + gumbel(fold_in(key_r, s))), with
    the logits of a cache-free forward over the prompt and the tokens so far."""
    cfg = dataclasses.replace(TINY, qkv_bias=True)
    model = random_model(cfg, seed=5, std=0.25)
    prompts = [[1, 5, 9, 13], [1, 7], [1, 20, 30, 40, 50, 21]]
    keys = jax.random.split(jax.random.key(7), 3)
    temp, new = 0.9, 8
    out = StaticSampler(cfg, pad_id=0, eos_id=2, decode_layout="token_major").generate(
        model, prompts, keys, SamplingParams(max_new_tokens=new, temperature=temp)
    )
    forward = jax.jit(lambda m, t, k: m(t, positions_from_mask(k), k)[0])
    for r, prompt in enumerate(prompts):
        seq = list(prompt)
        for s in range(int(out.lengths[r])):
            logits = forward(model, jnp.asarray([seq]), jnp.ones((1, len(seq)), jnp.int32))
            g = jax.random.gumbel(jax.random.fold_in(keys[r], s), (cfg.vocab_size,))
            seq.append(int(jnp.argmax(logits[0, -1] / temp + g)))
        np.testing.assert_array_equal(out.tokens[r, : out.lengths[r]], seq[len(prompt) :])


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_equals_no_remat_in_values_and_gradients(remat):
    """model.remat recomputes activations in the backward pass instead of storing them:
    the log-probs and their gradients are the same as without it."""
    cfg = TINY
    model = random_model(cfg, seed=2)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 12)), jnp.int32)
    mask = jnp.asarray(np.r_[np.zeros(2), np.ones(10)][None].repeat(3, 0), jnp.int32)

    def loss_and_grads(m):
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)

        def f(p):
            out = sequence_logprobs(nnx.merge(graphdef, p, rest), tokens, mask, 0.7)
            return out.sum(), out

        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

    (_, ref), ref_g = loss_and_grads(model)
    rematted = random_model(dataclasses.replace(cfg, remat=remat), seed=2)
    graphdef, params, rest = nnx.split(rematted, nnx.Param, ...)
    jaxpr = jax.make_jaxpr(lambda p: sequence_logprobs(nnx.merge(graphdef, p, rest), tokens, mask))
    text = str(jaxpr(params))
    assert text.count("remat2[") == 1 and "scan[" in text  # one checkpointed scan step
    (_, out), g = loss_and_grads(rematted)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    # Recomputation reorders float sums: compare at the gradients' own scale.
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()) + 1e-7)


@pytest.mark.parametrize("attention", ["chunked", "xla", "auto"])
def test_fused_attention_equals_dense_in_values_and_gradients(attention):
    """model.attention "chunked" (blocks of 5 queries of 12: one not full) and through
    jax.nn.dot_product_attention (on CPU: its XLA path) give the dense path's log-probs
    and gradients, left padding (rows with no visible key) included."""
    cfg = dataclasses.replace(TINY, num_heads=4, num_kv_heads=2)  # grouped queries
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (3, 12)), jnp.int32)
    mask = np.ones((3, 12), np.int32)
    mask[1, :4] = mask[2, :7] = 0  # left padding
    mask = jnp.asarray(mask)

    def run(c):
        graphdef, params, rest = nnx.split(random_model(c, seed=4), nnx.Param, ...)

        def f(p):
            out = sequence_logprobs(nnx.merge(graphdef, p, rest), tokens, mask, 1.0)
            return out.sum(), out

        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

    (_, ref), ref_g = run(cfg)
    fused = dataclasses.replace(cfg, attention=attention, attention_chunk=5)
    if attention == "chunked":  # the blocks are a loop (the LM head is dense at 36 tokens)
        model = random_model(fused, seed=4)
        assert "scan[" in str(jax.make_jaxpr(lambda: sequence_logprobs(model, tokens, mask))())
    (_, out), g = run(fused)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g), strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()) + 1e-7)


def test_cudnn_attention_is_really_dispatched_and_needs_a_gpu():
    """The setting reaches jax.nn.dot_product_attention: "cudnn" on a CPU fails there."""
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is here: cuDNN attention may run")
    model = random_model(dataclasses.replace(TINY, attention="cudnn"), seed=0)
    with pytest.raises(RuntimeError, match="cuDNN"):
        sequence_logprobs(model, jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32))


def test_splash_attention_equals_dense_in_values_and_gradients():
    """model.attention="splash" (the TPU Pallas kernel, interpreted on CPU) gives the
    dense path's log-probs and gradients: left padding through the key mask as segment
    ids, and packed rows through their segment ids; a length off its blocks is refused."""
    cfg = dataclasses.replace(TINY, num_heads=4, num_kv_heads=2)  # grouped queries
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 128)), jnp.int32)
    mask = np.ones((2, 128), np.int32)
    mask[1, :40] = 0  # left padding
    segments = np.repeat(np.array([[1, 2, 3, 0]]), 32, axis=1).repeat(2, axis=0)  # packed

    def run(c):
        graphdef, params, rest = nnx.split(random_model(c, seed=6), nnx.Param, ...)

        def f(p):
            model = nnx.merge(graphdef, p, rest)
            lp = sequence_logprobs(model, tokens, jnp.asarray(mask), 1.0)
            # A row's first real token has no prefix: its "log-prob" comes from a pad
            # query's output, which no kernel defines (dense: no key; splash: pads).
            lp = jnp.where(jnp.asarray(np.pad(mask[:, :-1], ((0, 0), (1, 0)))) > 0, lp, 0.0)
            pos = jnp.asarray(np.where(segments > 0, np.arange(128) % 32, 0), jnp.int32)
            seg = jnp.asarray(segments, jnp.int32)
            h, _ = model.hidden(tokens, pos, (seg > 0).astype(jnp.int32), segments=seg)
            packed = jnp.where(seg[..., None] > 0, h, 0.0)  # pad queries: undefined
            return lp.sum() + packed.sum(), (lp, packed)

        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

    (_, ref), ref_g = run(cfg)
    (_, out), g = run(dataclasses.replace(cfg, attention="splash"))
    for a, b in zip(out, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()) + 1e-7)
    model = random_model(dataclasses.replace(cfg, attention="splash"), seed=0)
    with pytest.raises(ValueError, match="multiple of 128; got 100"):
        sequence_logprobs(model, tokens[:, :100], jnp.asarray(mask[:, :100]))
