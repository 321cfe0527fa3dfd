"""Decoder-only transformer of the Llama/Qwen2/Qwen3(-MoE) family in Flax NNX.

Architecture (Hugging Face `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM`):
token embedding, `num_layers` pre-norm blocks (RMSNorm -> grouped-query attention with
RoPE -> residual, RMSNorm -> SwiGLU MLP -> residual), final RMSNorm, LM head (or the tied
embedding). `cfg.qk_norm` (Qwen3) adds an RMSNorm over head_dim on every query and key
head, before RoPE.

Parameter layout. Module attribute names mirror HF so an importer is a pure renaming plus
transposition. The flat names used by `flat_params` / `load_flat_params` (and stored by the
parameter server) are the NNX attribute paths joined with dots:

    embed_tokens.embedding                    [vocab, hidden]      HF model.embed_tokens.weight
    layers.{i}.input_layernorm.weight         [hidden]             HF model.layers.{i}.input_layernorm.weight
    layers.{i}.self_attn.q_proj.kernel        [hidden, heads*hd]   HF ...q_proj.weight, transposed
    layers.{i}.self_attn.q_proj.bias          [heads*hd]           only when qkv_bias (Qwen2)
    layers.{i}.self_attn.{k,v}_proj.kernel    [hidden, kv*hd]      (+ .bias when qkv_bias)
    layers.{i}.self_attn.{q,k}_norm.weight    [hd]                 only when qk_norm (Qwen3)
    layers.{i}.self_attn.o_proj.kernel        [heads*hd, hidden]
    layers.{i}.post_attention_layernorm.weight[hidden]
    layers.{i}.mlp.{gate,up}_proj.kernel      [hidden, inter]
    layers.{i}.mlp.down_proj.kernel           [inter, hidden]
    layers.{i}.mlp.gate.kernel                [hidden, experts]    MoE (cfg.num_experts > 0) instead
    layers.{i}.mlp.experts.{gate,up}_proj.kernel [experts, hidden, moe_inter]  of the MLP: router,
    layers.{i}.mlp.experts.down_proj.kernel   [experts, moe_inter, hidden]     stacked experts,
    layers.{i}.mlp.shared_expert.*            as mlp.*             when shared_expert_intermediate_size
    norm.weight                               [hidden]             HF model.norm.weight
    lm_head.kernel                            [hidden, vocab]      HF lm_head.weight, transposed;
                                                                   absent when tie_embeddings

Linear kernels are stored [in, out] (the Flax convention, `y = x @ kernel`); HF stores
`weight` as [out, in], so the importer transposes every `*.kernel`. Parameters are always
float32; `cfg.dtype == "bfloat16"` casts activations and weights for the matmuls only.

Token layout and masking follow docs/CONVENTIONS.md: positions are
`max(cumsum(mask) - 1, 0)` and query i sees key j iff j <= i and mask[j] == 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipeline.config import ModelConfig
from pipeline.lora import LoraConfig
from tpu_jobs.model import moe
from tpu_jobs.model.constraints import constrain, current_mesh
from tpu_jobs.model.lm_head import head_logits, token_logprobs
from tpu_jobs.model.matmul import matmul
from tpu_jobs.model.moe import RouterOutputs

DTYPES: dict[str, jnp.dtype] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# model.remat -> the `jax.checkpoint` policy of a decoder layer without a cache (what to
# save for the backward pass; None: nothing beyond the layer's inputs). "none" is absent:
# no checkpoint at all.
REMAT: dict[str, Callable[..., bool] | None] = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
INIT_STD = 0.02
# Masked attention scores: finite so a query that sees no key (a left-pad query) yields a
# uniform softmax instead of NaN; its output is never used.
_MASKED = -1e30


def _dtype(name: str) -> jnp.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is invalid; allowed: {', '.join(map(repr, DTYPES))}")
    return DTYPES[name]


# --------------------------------------------------------------------------- KV cache


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Preallocated keys/values of every layer plus the mask of the key slots.

    k, v: [layers, batch, max_len, kv_heads, head_dim] (post-RoPE keys, like HF);
    mask: [batch, max_len] int32, 1 where the slot holds a real token.

    Per-layer layout (`init_cache(..., per_layer=True)`, used by the sampler): k and v are
    tuples with one array per layer, k[i]: [batch, kv_heads, head_dim, max_len] and
    v[i]: [batch, kv_heads, max_len, head_dim], the layouts the attention matmuls read
    directly. With the stacked layout XLA:CPU copies (transposes) every layer's keys and
    values at every decode step, which was ~1/3 of the decode time of small models.
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    mask: jax.Array

    @property
    def max_len(self) -> int:
        return self.mask.shape[1]

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple | list)


def init_cache(
    cfg: ModelConfig,
    batch: int,
    max_len: int,
    dtype: str | None = None,
    *,
    per_layer: bool = False,
) -> KVCache:
    """An empty cache; `dtype` defaults to the model's compute dtype."""
    dt = _dtype(dtype or cfg.dtype)
    mask = jnp.zeros((batch, max_len), jnp.int32)
    kv, hd = cfg.num_kv_heads, cfg.head_dim
    if per_layer:
        n = cfg.num_layers
        k = tuple(jnp.zeros((batch, kv, hd, max_len), dt) for _ in range(n))
        v = tuple(jnp.zeros((batch, kv, max_len, hd), dt) for _ in range(n))
        return KVCache(k=k, v=v, mask=mask)
    shape = (cfg.num_layers, batch, max_len, kv, hd)
    return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), mask=mask)


# --------------------------------------------------------------------------- pure math


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """HF RMSNorm over `axis` (the feature axis): computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    shape = [1] * x.ndim
    shape[axis] = -1
    return (y * weight.astype(jnp.float32).reshape(shape)).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, 1, head_dim] in HF's layout (frequencies repeated, not interleaved)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] (HF convention)."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


# --------------------------------------------------------------------------- modules


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


@dataclass(frozen=True)
class Adapters:
    """How the model's projections carry LoRA adapters (`pipeline.lora`): the run's `lora`
    section and the key stream of the adapters' initialisation (apart from the base's, so a
    base initialised with the same seed is the same with or without adapters)."""

    cfg: LoraConfig
    rngs: nnx.Rngs

    def rank(self, target: str) -> int:
        return self.cfg.rank if target in self.cfg.targets else 0


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel stored [in, out] (HF's weight transposed).

    With a LoRA rank > 0 it also holds `lora_a` [in, rank] and `lora_b` [rank, out] as
    `nnx.LoRAParam` (a `Param` subtype: the trainer splits them from the frozen base by that
    type, `tpu_jobs.model.state.split_lora`) and adds `scale * (x @ lora_a) @ lora_b`
    (`pipeline.lora`'s contract). Unmerged on purpose: the base stays frozen and shared with
    the KL reference. A is uniform in +-1/sqrt(in) (PEFT's kaiming_uniform(a=sqrt(5))), B is
    zero, so a fresh adapter leaves the base's output unchanged."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        bias: bool,
        std: float,
        rngs: nnx.Rngs,
        lora: Adapters | None = None,
        target: str = "",
    ):
        self.kernel = _normal(rngs, (d_in, d_out), std)
        self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32)) if bias else None
        rank = 0 if lora is None else lora.rank(target)
        a = b = None
        if rank:
            bound = 1.0 / math.sqrt(d_in)
            a = jax.random.uniform(lora.rngs.params(), (d_in, rank), jnp.float32, -bound, bound)
            a, b = nnx.LoRAParam(a), nnx.LoRAParam(jnp.zeros((rank, d_out), jnp.float32))
        self.lora_a, self.lora_b = a, b
        self.lora_scale = lora.cfg.scale if rank else 0.0
        self.lora_dropout = lora.cfg.dropout if rank else 0.0

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """`dropout_key`: training's key of this projection (`lora.dropout` on the adapter's
        input; None: no dropout, as at inference)."""
        y = matmul(x, self.kernel[...].astype(x.dtype))
        if self.lora_a is not None:
            xa = x
            if dropout_key is not None and self.lora_dropout > 0:
                xa = dropout(x, self.lora_dropout, dropout_key)
            low = matmul(xa, self.lora_a[...].astype(x.dtype))
            y = y + self.lora_scale * matmul(low, self.lora_b[...].astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    """Inverted dropout: each element zeroed with probability `rate`, the rest / (1 - rate)."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def _keys(key: jax.Array | None, n: int) -> list[jax.Array | None]:
    """n independent keys of one module's projections (None stays None: no dropout)."""
    return [None] * n if key is None else [jax.random.fold_in(key, i) for i in range(n)]


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs):
        self.embedding = _normal(rngs, (vocab, dim), INIT_STD)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: Adapters | None = None):
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        out_std = INIT_STD / math.sqrt(2 * cfg.num_layers)  # GPT-2 style residual scaling
        qkv = {"bias": cfg.qkv_bias, "std": INIT_STD, "rngs": rngs, "lora": lora}
        self.q_proj = Linear(h, nh * hd, **qkv, target="q")
        self.k_proj = Linear(h, nkv * hd, **qkv, target="k")
        self.v_proj = Linear(h, nkv * hd, **qkv, target="v")
        self.o_proj = Linear(nh * hd, h, bias=False, std=out_std, rngs=rngs, lora=lora, target="o")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.attention, self.attention_chunk = cfg.attention, cfg.attention_chunk

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        visible: jax.Array,
        cache_kv: tuple[jax.Array, jax.Array, int, jax.Array] | None,
        segments: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """visible: [B, T, S] bool. cache_kv: (k_all, v_all, layer, slot) or None; layer is
        None for a per-layer cache (k_all, v_all: this layer's arrays, see KVCache).
        segments: [B, T] int, the same visibility as segment ids (without a cache: query
        i sees key j iff j <= i and their ids are equal), for kernels that take those.
        dropout_key: LoRA dropout in training (`Linear`)."""
        b, t, _ = x.shape
        nkv, hd = self.num_kv_heads, self.head_dim
        heads = ("batch", None, "heads", None)
        kq, kk, kv, ko = _keys(dropout_key, 4)
        q = constrain(self.q_proj(x, kq).reshape(b, t, self.num_heads, hd), *heads)
        k = constrain(self.k_proj(x, kk).reshape(b, t, nkv, hd), *heads)
        v = constrain(self.v_proj(x, kv).reshape(b, t, nkv, hd), *heads)
        q, k = self.norm_rope(q, k, cos, sin)
        out, new_cache = self.attend(q, k, v, visible, cache_kv, segments)
        out = constrain(out, "batch", None, "heads")
        return constrain(self.o_proj(out, ko), "batch", None, None), new_cache

    def norm_rope(self, q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array):
        """q [B, T, heads, hd], k [B, T, kv, hd] -> (q, k) after q/k norm (Qwen3) and RoPE."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        visible: jax.Array,
        cache_kv: tuple[jax.Array, jax.Array, int, jax.Array] | None,
        segments: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Attention of post-RoPE q [B, T, heads, hd] over k, v [B, T, kv, hd] (and the
        cache, which gets them written at `slot`): (output [B, T, heads*hd] before o_proj,
        updated (k, v) cache arrays or None)."""
        if hasattr(
            cache_kv, "attend"
        ):  # a cache kept outside the model (tpu_jobs.generate.kv_pages)
            return cache_kv.attend(q, k, v)
        b, t, _, hd = q.shape
        nkv, g = self.num_kv_heads, self.num_heads // self.num_kv_heads
        new_cache = None
        if cache_kv is not None and cache_kv[2] is None:
            return self._attend_per_layer(q, k, v, visible, *cache_kv[:2], cache_kv[3])
        if cache_kv is not None:
            k_all, v_all, layer, slot = cache_kv
            start = (layer, 0, slot, 0, 0)
            k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), start)
            v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), start)
            new_cache = (k_all, v_all)
            s = visible.shape[-1]  # the slots that can be visible (see Transformer.hidden)
            k, v = k_all[layer, :, :s].astype(q.dtype), v_all[layer, :, :s].astype(q.dtype)
        q = q.reshape(b, t, nkv, g, hd)
        # With a cache (the sampler's prefill over a shared cache) always the dense path.
        attend = ATTENTION["dense" if cache_kv is not None else self.attention]
        out = attend(q, k, v, visible, self.attention_chunk, segments)
        return out.reshape(b, t, self.num_heads * hd), new_cache

    def _attend_per_layer(self, q, k, v, visible, k_cache, v_cache, slot):
        """Attention over a per-layer cache: k_cache [B, kv, hd, S], v_cache [B, kv, S, hd]."""
        b, t, _, hd = q.shape
        nkv, g = self.num_kv_heads, self.num_heads // self.num_kv_heads
        zero = jnp.int32(0)
        kt = k.transpose(0, 2, 3, 1).astype(k_cache.dtype)  # [B, kv, hd, T]
        k_cache = jax.lax.dynamic_update_slice(k_cache, kt, (zero, zero, zero, slot))
        vt = v.transpose(0, 2, 1, 3).astype(v_cache.dtype)  # [B, kv, T, hd]
        v_cache = jax.lax.dynamic_update_slice(v_cache, vt, (zero, zero, slot, zero))
        if t == 1:
            return self.decode_attend(q, visible, k_cache, v_cache), (k_cache, v_cache)
        # Plain batched matmuls over (B, kv) with rows (g, T): XLA:CPU runs them as library
        # matmuls on the cache buffers in place. Only the slots that can be visible are
        # read (a prefill from slot 0 sees its own T, not the whole cache: at 64 x (256 +
        # 4k) the scores over every slot were 4 GB per copy).
        s = visible.shape[-1]
        k_seen, v_seen = k_cache[..., :s], v_cache[:, :, :s]
        q = q.reshape(b, t, nkv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, nkv, g * t, hd)
        scores = jnp.einsum(
            "bkmd,bkds->bkms", q, k_seen.astype(q.dtype), preferred_element_type=jnp.float32
        )
        scores = scores.reshape(b, nkv, g, t, -1) / math.sqrt(hd)
        scores = jnp.where(visible[:, None, None], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(b, nkv, g * t, -1)
        out = jnp.einsum(
            "bkms,bksd->bkmd", probs, v_seen.astype(q.dtype), preferred_element_type=jnp.float32
        ).astype(q.dtype)
        out = out.reshape(b, nkv, g, t, hd).transpose(0, 3, 1, 2, 4)  # [B, T, kv, g, hd]
        return out.reshape(b, t, self.num_heads * hd), (k_cache, v_cache)

    def decode_attend(self, q, visible, k_cache, v_cache):
        """One query token per row (decode): scores and outputs as broadcast products reduced
        over head_dim / slots, which XLA fuses into two loops over the cache. Decode
        attention is bound by reading the cache, and B x kv matmuls of g rows each cost
        ~1.5x as much on XLA:CPU (benchmarks/results/sampler_vs_hf.md). Returns
        [B, 1, heads*hd] before o_proj. q [B, 1, heads, hd]; visible [B, 1, S]; the caches
        in the per-layer layout (k [B, kv, hd, S], v [B, kv, S, hd]), the new key written."""
        return decode_attention(q, self.num_kv_heads, [(k_cache, v_cache, visible[:, :, None])])


def decode_attention(
    q: jax.Array, num_kv_heads: int, parts: Sequence[tuple[jax.Array, jax.Array, jax.Array]]
) -> jax.Array:
    """`Attention.decode_attend` over keys held in several parts, one softmax over all:
    `parts` [(k [B, kv, hd, S_i], v [B, kv, S_i, hd], visible broadcastable to [B, kv, g,
    S_i])]. The engine's feature-major decode reads the rows' cache before the chunk and
    the chunk's own new keys as two parts, so no step writes into the (large) cache copy.
    Returns [B, 1, heads * hd]."""
    b, _, heads, hd = q.shape
    qf = q.reshape(b, num_kv_heads, heads // num_kv_heads, hd, 1).astype(jnp.float32)
    scores = []
    for k, _, visible in parts:
        part = jnp.sum(qf * k[:, :, None].astype(jnp.float32), axis=3)  # [B, kv, g, S_i]
        scores.append(jnp.where(visible, part / math.sqrt(hd), _MASKED))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)[..., None]
    out, at = 0.0, 0
    for (_, v, _), part in zip(parts, scores, strict=True):
        n = part.shape[-1]
        p = probs[..., at : at + n, :]  # [B, kv, g, S_i, 1]
        out = out + jnp.sum(p * v[:, :, None].astype(jnp.float32), axis=3)  # [B, kv, g, hd]
        at += n
    return out.astype(q.dtype).reshape(b, 1, heads * hd)


def _dense_attention(q, k, v, visible) -> jax.Array:
    """q [B, T, kv, g, hd] over k, v [B, S, kv, hd], visible [B, T, S] bool: the output
    [B, T, kv, g, hd], through float32 probabilities [B, kv, g, T, S]."""
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    scores = jnp.where(visible[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def _query_chunked_attention(q, k, v, visible, chunk: int) -> jax.Array:
    """`_dense_attention` over blocks of `chunk` queries at a time (each block sees every
    key, so its softmax is exact), each block under `jax.checkpoint`: the probabilities
    of one block, [B, kv, g, chunk, S], exist at once, in the forward and in the backward
    pass, instead of all T rows. Queries are padded to a multiple of `chunk` (pad rows see
    no key and are dropped)."""
    b, t = q.shape[:2]
    if not 0 < chunk < t:  # one block: the dense computation
        return _dense_attention(q, k, v, visible)
    n = -(-t // chunk)
    pad = n * chunk - t
    qb = jnp.pad(q, ((0, 0), (0, pad)) + ((0, 0),) * 3)
    vis = jnp.pad(visible, ((0, 0), (0, pad), (0, 0)))
    qb = qb.reshape(b, n, chunk, *q.shape[2:]).swapaxes(0, 1)  # [n, B, chunk, kv, g, hd]
    vis = vis.reshape(b, n, chunk, -1).swapaxes(0, 1)

    def block(args):
        qc, vc = args
        return _dense_attention(qc, k, v, vc)

    out = jax.lax.map(jax.checkpoint(block), (qb, vis))  # [n, B, chunk, kv, g, hd]
    return out.swapaxes(0, 1).reshape(b, n * chunk, *q.shape[2:])[:, :t]


def _backend_attention(implementation: str | None):
    """`jax.nn.dot_product_attention` with `implementation` as an `ATTENTION` function:
    with "cudnn", flash attention that never stores the [B, heads, T, S] probabilities."""

    def attend(q, k, v, visible, chunk: int, segments=None) -> jax.Array:
        b, t, nkv, g, hd = q.shape
        out = jax.nn.dot_product_attention(
            q.reshape(b, t, nkv * g, hd), k, v, mask=visible[:, None],
            implementation=implementation,
        )  # fmt: skip
        return out.reshape(b, t, nkv, g, hd)

    return attend


def _splash_attention(q, k, v, visible, chunk: int, segments=None) -> jax.Array:
    """The Pallas splash (flash) attention kernel of TPUs
    (`jax.experimental.pallas.ops.tpu.splash_attention`): a causal mask and-ed with
    segment ids, blockwise, never storing [T, S] probabilities in HBM. One MQA kernel per
    KV head serves its group of query heads (GQA without repeating K and V). Off TPU it
    runs in Pallas's interpret mode: the same kernel, slowly, for tests on CPU.

    Sequence lengths must be multiples of 128 (the kernel's blocks); `segments` [B, T]
    (the key mask, or packed rows' segment ids) carries the padding."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, t, nkv, g, hd = q.shape
    if segments is None or k.shape[1] != t:
        raise ValueError("model.attention=splash is for self-attention without a cache")
    block = next((n for n in (512, 256, 128) if t % n == 0), None)
    if block is None:
        raise ValueError(
            f"model.attention=splash needs a sequence length that is a multiple of 128; got "
            f"{t} (prompt + completion): pad it, or use attention=chunked"
        )
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    kernel = splash.make_splash_mqa_single_device(
        splash.MultiHeadMask([splash.CausalMask((t, t))] * g),
        block_sizes=sizes,
        interpret=jax.default_backend() != "tpu",
    )
    scale = 1.0 / math.sqrt(hd)  # the kernel takes scaled queries
    qh = (q * scale).transpose(0, 2, 3, 1, 4)  # [B, kv, g, T, hd]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, kv, T, hd]

    def one(qg, kg, vg, seg):  # one row, one KV head: q [g, T, hd], k, v [T, hd]
        return kernel(qg, kg, vg, segment_ids=splash.SegmentIds(q=seg, kv=seg))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_head)(qh, kh, vh, segments.astype(jnp.int32))  # [B, kv, g, T, hd]
    return out.transpose(0, 3, 1, 2, 4).astype(q.dtype)


# model.attention -> attention without a cache (training forwards, scoring): q
# [B, T, kv, g, hd] over k, v [B, S, kv, hd], visible [B, T, S] bool, model.attention_chunk,
# segments [B, T] int (the same visibility as segment ids) -> [B, T, kv, g, hd]. The one
# place a platform's kernel slots in.
ATTENTION: dict[str, Callable[..., jax.Array]] = {
    "dense": lambda q, k, v, visible, chunk, segments=None: _dense_attention(q, k, v, visible),
    "chunked": lambda q, k, v, visible, chunk, segments=None: _query_chunked_attention(
        q, k, v, visible, chunk
    ),
    "xla": _backend_attention("xla"),
    "cudnn": _backend_attention("cudnn"),
    "auto": _backend_attention(None),
    "splash": _splash_attention,
}


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: Adapters | None = None):
        h, i = cfg.hidden_size, cfg.intermediate_size
        out_std = INIT_STD / math.sqrt(2 * cfg.num_layers)
        common = {"bias": False, "rngs": rngs, "lora": lora}
        self.gate_proj = Linear(h, i, std=INIT_STD, **common, target="gate")
        self.up_proj = Linear(h, i, std=INIT_STD, **common, target="up")
        self.down_proj = Linear(i, h, std=out_std, **common, target="down")

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        kg, ku, kd = _keys(dropout_key, 3)
        gate = constrain(self.gate_proj(x, kg), "batch", None, "mlp")
        up = constrain(self.up_proj(x, ku), "batch", None, "mlp")
        return constrain(self.down_proj(jax.nn.silu(gate) * up, kd), "batch", None, None)


class ExpertKernels(nnx.Module):
    """One projection of every expert: kernel [experts, in, out] (HF's per-expert weights
    [out, in], stacked and transposed)."""

    def __init__(self, experts: int, d_in: int, d_out: int, *, std: float, rngs: nnx.Rngs):
        self.kernel = _normal(rngs, (experts, d_in, d_out), std)


class Experts(nnx.Module):
    """The SwiGLU experts of a MoE layer, stacked (`tpu_jobs.model.moe.dropless_experts`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        out_std = INIT_STD / math.sqrt(2 * cfg.num_layers)
        self.gate_proj = ExpertKernels(e, h, i, std=INIT_STD, rngs=rngs)
        self.up_proj = ExpertKernels(e, h, i, std=INIT_STD, rngs=rngs)
        self.down_proj = ExpertKernels(e, i, h, std=out_std, rngs=rngs)


class MoE(nnx.Module):
    """Mixture-of-experts MLP (Qwen3-MoE's sparse block): a router `gate` [hidden, experts]
    picks `num_experts_per_tok` experts per token (`tpu_jobs.model.moe.route`), which run
    dropless (`moe.DISPATCH[model.moe_dispatch]`); plus an ungated `shared_expert` MLP every token
    goes through when `shared_expert_intermediate_size` > 0. LoRA adapters are not
    supported here (`pipeline.lora` refuses MLP targets on a MoE model)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False, std=INIT_STD, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs)
        shared = replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
        self.shared_expert = MLP(shared, rngs=rngs) if cfg.shared_expert_intermediate_size else None
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.dispatch = cfg.moe_dispatch

    def __call__(
        self, x: jax.Array, routing: jax.Array | None = None
    ) -> tuple[jax.Array, RouterOutputs]:
        """x [B, T, H] -> (output [B, T, H], this layer's RouterOutputs with logits
        [B, T, E] and experts [B, T, k]). `routing` [B, T, k] int: use these experts
        instead of the router's top-k (routing replay; the weights still come from the
        router's probabilities, so the router keeps its gradient)."""
        b, t, h = x.shape
        logits = self.gate(x).astype(jnp.float32)
        weights, experts = moe.route(logits, self.top_k, self.norm_topk_prob, routing)
        ex = self.experts
        args = (
            x.reshape(b * t, h),
            experts.reshape(b * t, -1),
            weights.reshape(b * t, -1),
            ex.gate_proj.kernel[...],
            ex.up_proj.kernel[...],
            ex.down_proj.kernel[...],
        )
        fn = moe.dispatch(self.dispatch, jax.default_backend())
        mesh = current_mesh()
        # On a mesh each device dispatches its own tokens to its own experts; unsharded,
        # the whole batch is one device's anyway.
        y = fn(*args) if mesh is None or mesh.size == 1 else moe.expert_parallel(fn, mesh, *args)
        y = y.reshape(b, t, h)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x)
        return constrain(y, "batch", None, None), RouterOutputs(logits, experts)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: Adapters | None = None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rngs=rngs, lora=lora)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, rngs=rngs) if cfg.moe else MLP(cfg, rngs=rngs, lora=lora)

    def __call__(self, x, cos, sin, visible, cache_kv, segments=None, dropout_key=None):
        """(output, updated cache arrays or None): `forward` without the router's outputs
        (what the samplers' decode steps call)."""
        return self.forward(x, cos, sin, visible, cache_kv, segments, dropout_key)[:2]

    def forward(
        self, x, cos, sin, visible, cache_kv, segments=None, dropout_key=None, routing=None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, RouterOutputs | None]:
        """(output, updated cache arrays or None, the MoE router's outputs or None for a
        dense MLP). `routing` [B, T, k]: the experts to use (MoE only; `MoE.__call__`)."""
        k_attn, k_mlp = _keys(dropout_key, 2)
        attn, new_cache = self.self_attn(
            self.input_layernorm(x), cos, sin, visible, cache_kv, segments, k_attn
        )
        x = x + attn
        h = self.post_attention_layernorm(x)
        router = None
        if isinstance(self.mlp, MoE):
            out, router = self.mlp(h, routing)
        else:
            out = self.mlp(h, k_mlp)
        return x + out, new_cache, router


class Transformer(nnx.Module):
    """Llama/Qwen2/Qwen3-style causal LM. See the module docstring for parameter names;
    `lora`: adapters on the target projections (`Linear`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: Adapters | None = None):
        self.cfg = cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(cfg, rngs=rngs, lora=lora) for _ in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(
                cfg.hidden_size, cfg.vocab_size, bias=False, std=INIT_STD, rngs=rngs
            )

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        cache: KVCache | None = None,
        cache_index: jax.Array | int | None = None,
        *,
        dtype: str | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Logits float32 [B, T, V] and the updated cache (None when `cache` is None).

        tokens, positions, mask: [B, T] ints. Without a cache, query i sees key j iff
        j <= i and mask[j] == 1. With a cache, the T tokens are written at slots
        `cache_index .. cache_index + T - 1` (their mask into `cache.mask`) and query i sees
        every cache slot j <= cache_index + i whose mask is 1. `dtype` overrides cfg.dtype.

        At a real vocabulary [B, T, V] is large: callers that need only some positions'
        logits, or only log-probs, take `hidden` and the head (`lm_head.head_logits`,
        `lm_head.token_logprobs`) instead.
        """
        x, new_cache = self.hidden(tokens, positions, mask, cache, cache_index, dtype=dtype)
        return self.logits(x), new_cache

    def head(self) -> tuple[jax.Array, bool]:
        """The LM head's weight and whether it is [vocab, hidden] (the tied embedding)
        rather than [hidden, vocab] (lm_head.kernel); for `tpu_jobs.model.lm_head`."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...], True
        return self.lm_head.kernel[...], False

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] of final hidden states [..., H] (as `hidden` returns)."""
        weight, vocab_major = self.head()
        return head_logits(hidden, weight, vocab_major=vocab_major)

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        cache: KVCache | None = None,
        cache_index: jax.Array | int | None = None,
        *,
        dtype: str | None = None,
        segments: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Final hidden states [B, T, H] (after the last RMSNorm, in the compute dtype) and
        the updated cache: `__call__` without the LM head (same arguments).

        `segments` [B, T] int (no cache; `tpu_jobs.learning.packing`): several sequences per row,
        query i sees key j iff j <= i and both are in the same segment (> 0)."""
        x, new_cache, _ = self._layers(
            tokens, positions, mask, cache, cache_index, dtype, segments, None
        )
        return x, new_cache

    def hidden_and_router(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        *,
        dtype: str | None = None,
        segments: jax.Array | None = None,
        routing: jax.Array | None = None,
    ) -> tuple[jax.Array, RouterOutputs | None]:
        """The cache-less `hidden` (training forwards) and what the MoE routers decided,
        every layer's stacked (`tpu_jobs.model.moe.RouterOutputs`; None for a dense model),
        for the router losses and the expert-load metrics.

        `routing` [layers, B, T, k] int (MoE only): the experts every token goes to in
        every layer instead of the routers' top-k, e.g. the sampler's recorded choices
        (routing replay); a forward's own `RouterOutputs.experts` reproduces it exactly."""
        if routing is not None and not self.cfg.moe:
            raise ValueError("routing= is for mixture-of-experts models (model.num_experts > 0)")
        x, _, router = self._layers(tokens, positions, mask, None, None, dtype, segments, routing)
        return x, router

    def cached_hidden_and_router(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        cache: KVCache,
        cache_index: jax.Array | int,
        *,
        dtype: str | None = None,
    ) -> tuple[jax.Array, KVCache, RouterOutputs | None]:
        """`hidden` with a cache (the samplers' prefill and decode steps) and what the MoE
        routers decided for the fed tokens (None for a dense model): what the samplers
        record for routing replay (`RouterOutputs.experts` [layers, B, T, k])."""
        return self._layers(tokens, positions, mask, cache, cache_index, dtype, None, None)

    def _layers(self, tokens, positions, mask, cache, cache_index, dtype, segments, routing):
        """(`hidden`'s two results, the routers' outputs stacked over layers or None):
        `hidden`'s arguments and `hidden_and_router`'s `routing`."""
        cdt = _dtype(dtype or self.cfg.dtype)
        b, t = tokens.shape
        mask = mask.astype(jnp.int32)
        x = constrain(self.embed_tokens(tokens).astype(cdt), "batch", None, None)
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
        if cache is None:
            key_mask, slot = mask, jnp.int32(0)
        else:
            slot = jnp.asarray(0 if cache_index is None else cache_index, jnp.int32)
            key_mask = jax.lax.dynamic_update_slice(cache.mask, mask, (jnp.int32(0), slot))
        if segments is not None:
            if cache is not None:
                raise ValueError("segments (packed rows) are for the cache-less forward")
            visible = segment_visible(segments)
        else:
            visible = visible_keys(key_mask, slot, t)
        # The same visibility as segment ids, for kernels that take those (splash): the
        # packed rows' ids, or the key mask (pads are segment 0 and see only pads).
        key_segments = None
        if cache is None:
            key_segments = segments if segments is not None else mask
        if cache is not None and isinstance(cache_index, int):
            # A slot known at trace time (the sampler's prefill from 0): no key beyond
            # cache_index + T is visible, so attention reads only those slots.
            visible = visible[:, :, : min(cache_index + t, key_mask.shape[1])]

        k_all = v_all = None
        if cache is not None:
            k_all, v_all = cache.k, cache.v
            if cache.per_layer:
                k_all, v_all = list(k_all), list(v_all)
        # LoRA dropout in training: the key the trainer's step sets on its merged model
        # (`tpu_jobs.model.state.ModelFns.merge`); absent at inference and without LoRA.
        lora_key = None
        if cache is None and hasattr(self, "lora_dropout_key"):
            lora_key = self.lora_dropout_key[...]
        if cache is None and self.cfg.remat in REMAT:
            x, router = _remat_layers(
                self.layers,
                x,
                cos,
                sin,
                visible,
                REMAT[self.cfg.remat],
                key_segments,
                lora_key,
                routing,
            )
            return self.norm(x), None, router
        routers = []
        for i, layer in enumerate(self.layers):
            if cache is None:
                cache_kv = None
            elif cache.per_layer:
                cache_kv = (k_all[i], v_all[i], None, slot)
            else:
                cache_kv = (k_all, v_all, i, slot)
            layer_key = None if lora_key is None else jax.random.fold_in(lora_key, i)
            layer_routing = None if routing is None else routing[i]
            x, new_kv, router = layer.forward(
                x, cos, sin, visible, cache_kv, key_segments, layer_key, layer_routing
            )
            routers.append(router)
            if new_kv is not None and cache.per_layer:
                k_all[i], v_all[i] = new_kv
            elif new_kv is not None:
                k_all, v_all = new_kv
        if cache is not None and cache.per_layer:
            k_all, v_all = tuple(k_all), tuple(v_all)
        new_cache = None if cache is None else KVCache(k=k_all, v=v_all, mask=key_mask)
        router = None
        if self.cfg.moe:  # every layer's, stacked as the remat scan stacks them
            router = jax.tree.map(lambda *r: jnp.stack(r), *routers)
        return self.norm(x), new_cache, router


def _remat_layers(
    layers, x, cos, sin, visible, policy, segments=None, dropout_key=None, routing=None
) -> tuple[jax.Array, RouterOutputs | None]:
    """The decoder layers (no cache) as a `lax.scan` over their stacked weights, each step
    under `jax.checkpoint` with `policy` (`REMAT`).

    Why a scan and not a checkpoint per layer of the Python loop: a checkpointed layer's
    recomputation depends only on its saved input, so XLA is free to schedule all the
    layers' recomputations early, and on XLA:CPU it does: measured, 24 checkpointed layers
    of the Qwen2.5-0.5B shape at 8 x 2,048 kept 168 of 197 GiB. The scan's backward loop
    runs one layer at a time, so one layer's activations are live at once. The stack is a
    copy of the layers' weights inside the program (their gradients come back through
    it), paid once per step. Returns (output, the MoE routers' outputs stacked over layers
    or None); `routing` [layers, ...]: each layer's replayed experts (`hidden_and_router`).
    """
    graphdef, first = nnx.split(layers[0])
    stacked = jax.tree.map(lambda *w: jnp.stack(w), first, *(nnx.split(m)[1] for m in layers[1:]))

    def body(h: jax.Array, state: nnx.State) -> tuple[jax.Array, None]:
        return nnx.merge(graphdef, state)(h, cos, sin, visible, None, segments)[0], None

    if dropout_key is None and not isinstance(layers[0].mlp, MoE):
        x, _ = jax.lax.scan(jax.checkpoint(body, policy=policy), x, stacked)
        return x, None

    def body_full(h: jax.Array, xs) -> tuple[jax.Array, RouterOutputs | None]:
        state, i, layer_routing = xs
        layer = nnx.merge(graphdef, state)
        # layer i's key, as the loop of `Transformer.hidden` folds it
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
        out, _, router = layer.forward(h, cos, sin, visible, None, segments, key, layer_routing)
        return out, router

    layer_ids = jnp.arange(len(layers))
    return jax.lax.scan(jax.checkpoint(body_full, policy=policy), x, (stacked, layer_ids, routing))


# --------------------------------------------------------------------------- helpers


# Folded into the seed for the adapters' initialisation: its own key stream.
LORA_STREAM = 0x10A


def init_model(cfg: ModelConfig, seed: int, lora: LoraConfig | None = None) -> Transformer:
    """A freshly initialised model; identical parameters for the same (cfg, seed).

    `lora` (enabled): adapters on its target projections (`Linear`), initialised from their
    own key stream, so the base is the model `init_model(cfg, seed)` gives; the base (every
    `nnx.Param` that is not a `nnx.LoRAParam`) is stored in `lora.base_dtype`."""
    if lora is None or not lora.enabled:
        return Transformer(cfg, rngs=nnx.Rngs(params=seed))
    key = jax.random.fold_in(jax.random.key(seed), LORA_STREAM)
    adapters = Adapters(lora, nnx.Rngs(params=key))
    model = Transformer(cfg, rngs=nnx.Rngs(params=seed), lora=adapters)
    base_dtype = _dtype(lora.base_dtype)
    for _, var in nnx.to_flat_state(nnx.state(model, BASE_PARAMS)):
        var.set_value(var[...].astype(base_dtype))
    return model


# The frozen base of a model with adapters: every parameter that is not an adapter.
BASE_PARAMS = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters, computed from the config alone."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if cfg.qkv_bias else 0)
    attn += 2 * cfg.head_dim if cfg.qk_norm else 0
    mlp = 3 * h * i
    if cfg.moe:  # the router, the experts and the shared expert replace the MLP
        e, s = cfg.num_experts, cfg.shared_expert_intermediate_size
        mlp = h * e + 3 * e * h * cfg.moe_intermediate_size + 3 * h * s
    layer = attn + mlp + 2 * h
    return v * h + cfg.num_layers * layer + h + (0 if cfg.tie_embeddings else h * v)


def visible_keys(key_mask: jax.Array, slot: jax.Array, t: int) -> jax.Array:
    """[B, T, S] bool: query i (at slot `slot + i`) sees key slot j iff j <= slot + i and
    key_mask[:, j] == 1. key_mask: [B, S]."""
    q_slot = slot + jnp.arange(t, dtype=jnp.int32)
    k_slot = jnp.arange(key_mask.shape[1], dtype=jnp.int32)
    return (k_slot[None, None, :] <= q_slot[None, :, None]) & (key_mask[:, None, :] > 0)


def segment_visible(segments: jax.Array) -> jax.Array:
    """[B, T, T] bool: query i sees key j iff j <= i and segments[:, j] == segments[:, i]
    > 0 (packed rows, `tpu_jobs.learning.packing`)."""
    t = segments.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    same = segments[:, :, None] == segments[:, None, :]
    return causal[None] & same & (segments[:, None, :] > 0)


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """CONVENTIONS.md: positions = max(cumsum(mask) - 1, 0)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def sequence_logprobs(
    model: Transformer,
    tokens: jax.Array,
    mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    first: int = 0,
) -> jax.Array:
    """[B, T - first] float32: column t - first holds log p(tokens[:, t] | tokens[:, :t])
    under softmax(logits / temperature) (raw logits when temperature == 0), for t >= first;
    the column of t = 0 is 0 and masked tokens are 0. Jit-able and differentiable w.r.t.
    the model's parameters.

    The LM head runs only on the positions that predict tokens first.., in chunks of
    `cfg.logits_chunk` tokens (`tpu_jobs.model.lm_head.token_logprobs`): no [B, T, V] logits."""
    logp, _ = token_logprobs_of(model, tokens, mask, temperature, first=first)
    return logp


def token_logprobs_of(
    model: Transformer,
    tokens: jax.Array,
    mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    first: int = 0,
    entropy: bool = False,
    hidden: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """(log-probs as `sequence_logprobs`, the entropies of the same distributions or
    None), both [B, T - first] and 0 at t = 0 and on masked tokens. `hidden`: the model's
    final hidden states of (tokens, mask) when the caller already has them."""
    tokens = jnp.asarray(tokens)
    mask = jnp.asarray(mask).astype(jnp.int32)
    if hidden is None:
        hidden, _ = model.hidden(tokens, positions_from_mask(mask), mask)
    if not 0 <= first < tokens.shape[1]:
        raise ValueError(f"first={first} is invalid; allowed: 0 <= first < {tokens.shape[1]}")
    lo = max(first, 1)  # token 0 has no prefix
    weight, vocab_major = model.head()
    logp, ent = token_logprobs(
        hidden[:, lo - 1 : -1],
        tokens[:, lo:],
        weight,
        vocab_major=vocab_major,
        temperature=temperature,
        chunk=model.cfg.logits_chunk,
        entropy=entropy,
    )
    keep = mask[:, first:] > 0

    def per_token(x: jax.Array) -> jax.Array:
        x = jnp.pad(x, ((0, 0), (lo - first, 0)))
        return jnp.where(keep, x, 0.0)

    return per_token(logp), None if ent is None else per_token(ent)


def _param_items(model: nnx.Module):
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        yield ".".join(str(p) for p in path), var


def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """{dotted name: float32 array} (names in the module docstring). Copies to host."""
    return {name: np.asarray(jax.device_get(var[...])) for name, var in _param_items(model)}


def load_flat_params(model: nnx.Module, flat: dict[str, np.ndarray]) -> None:
    """Replace the model's parameters in place with `flat` (as made by `flat_params`).

    Every name must be present with the exact shape; values are cast to the parameter's
    dtype (float32). Raises ValueError listing missing, unexpected and mis-shaped tensors.
    """
    items = dict(_param_items(model))
    missing = sorted(set(items) - set(flat))
    unexpected = sorted(set(flat) - set(items))
    misshaped = [
        f"{name}: got {tuple(np.shape(flat[name]))}, expected {tuple(var[...].shape)}"
        for name, var in items.items()
        if name in flat and tuple(np.shape(flat[name])) != tuple(var[...].shape)
    ]
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append("missing: " + ", ".join(missing))
        if unexpected:
            parts.append("unexpected: " + ", ".join(unexpected))
        if misshaped:
            parts.append("mis-shaped: " + "; ".join(misshaped))
        raise ValueError(
            "load_flat_params: the tensors do not match the model's parameters; "
            + " | ".join(parts)
        )
    for name, var in items.items():
        var.set_value(jnp.asarray(flat[name], dtype=var[...].dtype))
