"""The sampler's one-token decode step, in two memory layouts (a registry).

* ``token_major``: the model's own forward (`tpu_jobs.model.transformer.Transformer`): activations
  [batch, hidden], every projection ``x @ kernel`` with kernels [in, out]. The usual
  layout on GPU/TPU.
* ``feature_major``: the same math on activations [hidden, batch], every projection
  ``W @ x`` with W [out, in] (HF's layout), so the batch is the minor dimension of the
  matmuls, and q/k/v (gate/up) are one stacked matrix each. On XLA:CPU a decode step of
  the 100m preset (64 rows against all the weights) runs ~13% faster this way
  (benchmarks/results/sampler_vs_hf.md). Attention stays token major: q, k, v (a few KB
  per row) are transposed into the model's own `Attention.attend`, so the KV cache,
  RoPE, q/k norms and masking are the model's code.

Both read the model's per-layer KV cache (`init_cache(per_layer=True)`), and prefill
(many rows per call, where `x @ kernel` is the faster form) is the model's forward for
both. `default_layout(platform, hidden_size)` picks feature_major on CPU for hidden sizes
>= 256 (smaller models are bound by per-call overheads, which its transposes add to),
token_major otherwise. The two give the same logits up to float32 summation order
(tests/tpu_jobs/test_decode.py; test_sampler.py runs the sampler tests in both).

A layout is `DecodeLayout(prepare, step)`:
  prepare(model) -> the weights `step` reads; computed once per weight version and
      compute dtype (`Sampler` caches it), outside the decode program.
  step(model, weights, token [B], pos [B], cache, slot, dtype) -> (logits [B, V] f32,
      cache): feed `token` at position `pos`, writing its key/value to cache `slot`.
`model`'s weights are already cast to the compute dtype `dtype` ("float32", "bfloat16").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tpu_jobs.generate.weight_copies import cast_state
from tpu_jobs.model.matmul import matmul, matmul_t
from tpu_jobs.model.mesh import platform_of
from tpu_jobs.model.transformer import (
    DTYPES,
    KVCache,
    Transformer,
    rms_norm,
    rope_tables,
    visible_keys,
)


@dataclass(frozen=True)
class DecodeLayout:
    prepare: Callable[[Transformer], Any]
    step: Callable[..., tuple[jax.Array, KVCache]]


# --------------------------------------------------------------------------- token major


def _token_major_prepare(model: Transformer) -> None:
    return None  # the model's forward reads its own weights


def _token_major_step(model, weights, token, pos, cache, slot, dtype):
    ones = jnp.ones_like(token)[:, None]
    logits, cache = model(token[:, None], pos[:, None], ones, cache, slot, dtype=dtype)
    return logits[:, 0], cache


# --------------------------------------------------------------------------- feature major


def _feature_major_prepare(model: Transformer) -> dict[str, Any]:
    """The step's weights as [out, in]: q/k/v stacked into one matrix (and their biases
    into one vector), gate/up into another, so a layer runs 4 matmuls instead of 7, each
    call having a fixed cost (row blocks of a feature-major output are contiguous:
    splitting them is free); the LM head as [vocab, hidden]. LoRA adapters are merged
    into their projections (kernel + scale * lora_a @ lora_b): the step reads kernels
    alone, and a sampler serves the adapted model, as vLLM does (merged)."""

    if model.cfg.moe:
        raise ValueError(
            "decode_layout='feature_major' has no mixture-of-experts MLP; allowed for "
            "model.num_experts > 0: 'token_major' (the model's own forward)"
        )

    def t(linear):
        kernel = linear.kernel[...]
        if linear.lora_a is not None:
            low = linear.lora_a[...].astype(jnp.float32) @ linear.lora_b[...].astype(jnp.float32)
            kernel = (kernel.astype(jnp.float32) + linear.lora_scale * low).astype(kernel.dtype)
        return kernel.T

    layers = []
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        projections = (att.q_proj, att.k_proj, att.v_proj)
        bias = None
        if att.q_proj.bias is not None:
            bias = jnp.concatenate([p.bias[...] for p in projections])
        layers.append(
            dict(
                qkv=jnp.concatenate([t(p) for p in projections]),
                qkv_bias=bias,
                o=t(att.o_proj),
                gate_up=jnp.concatenate([t(mlp.gate_proj), t(mlp.up_proj)]),
                down=t(mlp.down_proj),
            )
        )
    head = model.embed_tokens.embedding[...] if model.lm_head is None else t(model.lm_head)
    return dict(layers=layers, head=head)


def _barrier(x: jax.Array) -> jax.Array:
    """Keep XLA from folding a transpose next to a matmul into the matmul's operand
    (transpose(W @ h) -> h^T @ W^T): XLA:CPU runs that form ~2x slower than W @ h."""
    return jax.lax.optimization_barrier(x)


def feature_major_logits(
    model: Transformer,
    weights: dict[str, Any],
    token: jax.Array,
    pos: jax.Array,
    dtype: str,
    attend: Callable[[int, Any, jax.Array, jax.Array, jax.Array], jax.Array],
) -> jax.Array:
    """Float32 logits [B, V] of one token per row, at positions `pos` [B], through the
    feature-major layers (`_feature_major_prepare`'s weights). `attend(layer index, the layer's Attention, q [B, 1, heads, hd], k, v [B, 1, kv,
    hd])` writes k/v to the caller's cache and returns [B, 1, heads * hd] before o_proj:
    the static sampler's cache (one slot for every row) or the engine's rows (one position
    per row)."""
    cfg = model.cfg
    b, eps = token.shape[0], cfg.rms_norm_eps
    cos, sin = rope_tables(pos[:, None], cfg.head_dim, cfg.rope_theta)
    # Activations [H, B] are built row-major, the embedding's columns gathered, and o_proj
    # reads attention's token-major output as the right operand of an "a @ b.T": a
    # transposed [B, H] array handed to `W @ x` makes XLA:CPU run a bfloat16 dot in float32,
    # converting its weights at every call (100m preset, 64 rows: 86 against 19 ms for
    # the layers' matmuls; float32 the same either way).
    embedding = model.embed_tokens.embedding[...]
    x = jnp.take(embedding.T, token, axis=1).astype(DTYPES[dtype])
    for i, (layer, w) in enumerate(zip(model.layers, weights["layers"], strict=True)):
        att = layer.self_attn
        h = rms_norm(x, layer.input_layernorm.weight[...], eps, axis=0)  # [H, B]
        qkv = _barrier(matmul(w["qkv"], h)).T  # [B, (heads + 2 kv) * hd], token major
        if w["qkv_bias"] is not None:
            qkv = qkv + w["qkv_bias"]
        nq, nk = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
        q = qkv[:, :nq].reshape(b, 1, att.num_heads, att.head_dim)
        k = qkv[:, nq : nq + nk].reshape(b, 1, att.num_kv_heads, att.head_dim)
        v = qkv[:, nq + nk :].reshape(b, 1, att.num_kv_heads, att.head_dim)
        q, k = att.norm_rope(q, k, cos, sin)
        out = attend(i, att, q, k, v)
        x = x + matmul_t(w["o"], out.reshape(b, -1))
        h = rms_norm(x, layer.post_attention_layernorm.weight[...], eps, axis=0)
        gate_up = matmul(w["gate_up"], h)
        inter = gate_up.shape[0] // 2
        x = x + matmul(w["down"], jax.nn.silu(gate_up[:inter]) * gate_up[inter:])
    h = rms_norm(x, model.norm.weight[...], eps, axis=0)
    return _barrier(matmul(weights["head"], h, jnp.float32)).T  # [B, V]


def _feature_major_step(model, weights, token, pos, cache, slot, dtype):
    key_mask = jax.lax.dynamic_update_slice(
        cache.mask, jnp.ones_like(token)[:, None], (jnp.int32(0), slot)
    )
    visible = visible_keys(key_mask, slot, 1)
    k_all, v_all = list(cache.k), list(cache.v)

    def attend(i, att, q, k, v):
        out, (k_all[i], v_all[i]) = att.attend(q, k, v, visible, (k_all[i], v_all[i], None, slot))
        return out

    logits = feature_major_logits(model, weights, token, pos, dtype, attend)
    return logits, KVCache(k=tuple(k_all), v=tuple(v_all), mask=key_mask)


def prepare_state(graphdef: nnx.GraphDef, state: nnx.State, *, layout: DecodeLayout, dtype: str):
    """(the state in the compute dtype, or None when it is float32 already; the decode
    layout's weights (tpu_jobs.generate.decode_layouts) in that dtype). The cast state is made once per
    weight version and passed to the generate programs, so a bf16 program holds bf16
    weights only, not float32 ones plus a bf16 copy made inside every call."""
    cast = cast_state(state, dtype)
    return (None if dtype == "float32" else cast), layout.prepare(nnx.merge(graphdef, cast))


@functools.cache
def prepare_program(graphdef: nnx.GraphDef, layout: str, dtype: str) -> Callable:
    """`prepare_state` jitted for this model, decode layout (a DECODE_LAYOUTS name) and
    dtype: one per process, shared by the samplers and kept across weight versions (a new
    jit per version would trace and compile it again at every version)."""
    return jax.jit(
        functools.partial(prepare_state, graphdef, layout=DECODE_LAYOUTS[layout], dtype=dtype)
    )


# --------------------------------------------------------------------------- registry

DECODE_LAYOUTS: dict[str, DecodeLayout] = {
    "token_major": DecodeLayout(prepare=_token_major_prepare, step=_token_major_step),
    "feature_major": DecodeLayout(prepare=_feature_major_prepare, step=_feature_major_step),
}


# Below this hidden size the feature-major step's extra transposes cost more than its
# matmuls gain. Measured on 2 CPU cores, batch 64 (feature_major vs token_major, median):
# hidden 128: 0.9x, 256: 1.02x, 512: 1.09x, 768: 1.13x.
FEATURE_MAJOR_MIN_HIDDEN = 256


def default_layout(platform: str, hidden_size: int, *, moe: bool = False) -> str:
    """feature_major on CPU for dense models of hidden size >= FEATURE_MAJOR_MIN_HIDDEN
    (measured faster there), token_major otherwise, on GPU/TPU and for mixtures of experts
    (`moe`: feature_major has no expert dispatch)."""
    if platform == "cpu" and hidden_size >= FEATURE_MAJOR_MIN_HIDDEN and not moe:
        return "feature_major"
    return "token_major"


def resolve_layout(name: str | None, cfg, mesh: jax.sharding.Mesh | None = None) -> str:
    """A sampler's decode layout: `name`, checked, or (None) `default_layout` for the
    platform the sampler runs on (the mesh's, else the default device's)."""
    if name is None:
        name = default_layout(platform_of(mesh), cfg.hidden_size, moe=cfg.moe)
    if name not in DECODE_LAYOUTS:
        raise ValueError(
            f"decode_layout={name!r} is invalid; allowed: " + ", ".join(map(repr, DECODE_LAYOUTS))
        )
    return name
