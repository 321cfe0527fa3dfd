"""The static sampler: batched autoregressive sampling with a KV cache, the whole decode
loop inside one jit; the reference the engine is tested against.

Prompts of different lengths are left-padded to a common length (CONVENTIONS.md token
layout), so every row writes its next token into the same cache slot and one scalar
`cache_index` drives the cache. Batch size, prompt length and the number of new tokens are
padded up to buckets so each bucket compiles once; temperature, top-k and top-p values are
traced (changing them never recompiles; only switching top-k / top-p on or off does).

Randomness: the token of row r at step s is drawn with `fold_in(keys[r], s)`
(`tpu_jobs.generate.token_draw`), so a row's output depends only on its own key and prompt,
never on its position in the batch or on the other rows (up to float rounding differences
between shape buckets). When small (`NOISE_BUDGET`), the Gumbel noise of all steps is drawn
before the decode loop in one vectorised call: the same values as per-step
`jax.random.categorical` draws, without a per-step threefry loop.

Speed (XLA:CPU, see benchmarks/results/sampler_vs_hf.md): the cache donated to the jitted
program is updated in place, and it uses the model's per-layer KV cache layout
(`init_cache(per_layer=True)`), which the attention matmuls read without the per-step
transposes of the stacked layout. Together with the up-front noise this halved the time of
the `demo` preset. Larger models are bound by the float32 matmuls of the decode steps,
which the feature-major decode layout (tpu_jobs.generate.decode_layouts, the default on CPU for hidden
sizes >= 256) runs ~10-15% faster; its transposed weights are prepared once per weight
version and kept.

Log-probs and the top-k / top-p filter: `tpu_jobs.generate.token_draw`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import fields

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipeline.config import ModelConfig
from pipeline.rollouts import routing_dtype
from tpu_jobs.generate.decode_layouts import (
    DECODE_LAYOUTS,
    DecodeLayout,
    prepare_program,
    resolve_layout,
)
from tpu_jobs.generate.interface import SampleResult, SamplingParams, check_prompts
from tpu_jobs.generate.token_draw import NOISE_BUDGET, as_keys, sample_step, step_noise
from tpu_jobs.generate.weight_copies import cast_state, same_arrays
from tpu_jobs.model import mesh as meshlib
from tpu_jobs.model.batching import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_NEW_TOKEN_BUCKETS,
    DEFAULT_PROMPT_BUCKETS,
    bucket,
)
from tpu_jobs.model.transformer import DTYPES, KVCache, Transformer, init_cache, positions_from_mask


def prefill(
    model: Transformer, tokens: jax.Array, mask: jax.Array, cache: KVCache, dtype: str
) -> tuple[jax.Array, KVCache]:
    """Run left-padded prompts [B, P] through the model, writing the cache from slot 0:
    (float32 logits [B, V] at the last prompt position, the cache). The LM head runs at
    that position only (at a real vocabulary [B, P, V] logits would be most of the
    sampler's memory)."""
    hidden, cache = model.hidden(tokens, positions_from_mask(mask), mask, cache, 0, dtype=dtype)
    return model.logits(hidden[:, -1]), cache


def record_routing(
    routing: jax.Array, experts: jax.Array, fed: jax.Array, at: jax.Array | int, num_experts: int
) -> jax.Array:
    """`routing` [B, slots, layers, k] with the experts [layers, B, T, k] the routers chose
    for the T tokens fed at slots at..at+T-1 written in, where `fed` [B, T] is true; the
    other tokens get the not-recorded mark E (`pipeline.rollouts.routing_dtype`)."""
    rows = jnp.where(fed[:, :, None, None], jnp.moveaxis(experts, 0, 2), num_experts)
    return jax.lax.dynamic_update_slice(routing, rows.astype(routing.dtype), (0, at, 0, 0))


def _moe_step(model, weights, token, pos, cache, slot, dtype):
    """A MoE model's decode step (the token_major layout's, which is MoE's): (logits
    [B, V], cache, the experts of the fed tokens [layers, B, 1, k])."""
    ones = jnp.ones_like(token)[:, None]
    hidden, cache, router = model.cached_hidden_and_router(
        token[:, None], pos[:, None], ones, cache, slot, dtype=dtype
    )
    return model.logits(hidden[:, 0]), cache, router.experts


def _generate(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    weights,
    tokens: jax.Array,
    mask: jax.Array,
    keys: jax.Array,
    cache: KVCache,
    max_new: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    layout: DecodeLayout,
    n_new: int,
    dtype: str,
    use_top_k: bool,
    use_top_p: bool,
    eos_id: int,
    pad_id: int,
):
    """Prefill + while_loop decode. Returns (tokens, logprobs, lengths, finished, cache,
    routing): for a MoE model routing [B, P + n_new, layers, k] holds the experts of every
    fed token (prompt, then each generated token but the last; E elsewhere), else None."""
    # Cast the weights once, outside the loop, so the body does not re-cast every step.
    model = nnx.merge(graphdef, cast_state(state, dtype))
    b, p = tokens.shape
    sample = functools.partial(
        sample_step,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        use_top_k=use_top_k,
        use_top_p=use_top_p,
    )

    # The cache buffer is reused between calls: stale keys are hidden by a fresh mask.
    cache = KVCache(k=cache.k, v=cache.v, mask=jnp.zeros_like(cache.mask))
    moe = model.cfg.moe
    routing = None
    if moe:  # routing replay: record the routers' choices of every token fed
        e, shape = model.cfg.num_experts, (model.cfg.num_layers, model.cfg.num_experts_per_tok)
        hidden, cache, router = model.cached_hidden_and_router(
            tokens, positions_from_mask(mask), mask, cache, 0, dtype=dtype
        )
        logits = model.logits(hidden[:, -1])
        routing = jnp.full((b, p + n_new, *shape), e, routing_dtype(e))
        routing = record_routing(routing, router.experts, mask > 0, 0, e)
    else:
        logits, cache = prefill(model, tokens, mask, cache, dtype)
    vocab = logits.shape[-1]
    noise_all = None
    if b * n_new * vocab <= NOISE_BUDGET:
        # All steps' Gumbel noise in one vectorised draw: per step, a threefry loop over
        # [B, V] costs more than the matmuls of a small model.
        noise_all = step_noise(keys, jnp.arange(n_new, dtype=jnp.int32), vocab)
        # Materialise it here: otherwise XLA fuses the draw into the in-loop reads.
        noise_all = jax.lax.optimization_barrier(noise_all)

    def noise_at(step):
        if noise_all is None:
            return None
        return jax.lax.dynamic_index_in_dim(noise_all, step, axis=1, keepdims=False)

    token, logp = sample(logits, keys, jnp.int32(0), noise=noise_at(jnp.int32(0)))
    out_tok = jnp.full((b, n_new), pad_id, jnp.int32).at[:, 0].set(token)
    out_lp = jnp.zeros((b, n_new), jnp.float32).at[:, 0].set(logp)
    done = token == eos_id
    lengths = jnp.ones((b,), jnp.int32)
    pos = jnp.sum(mask, axis=-1).astype(jnp.int32)  # position of `token`

    def cond(carry):
        step, *_, done, _, _ = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, cache, token, pos, out_tok, out_lp, done, lengths, routing = carry
        # Feed the previous token (slot p + step - 1), then sample this step's token.
        if moe:
            logits, cache, experts = _moe_step(
                model, weights, token, pos, cache, p + step - 1, dtype
            )
            routing = record_routing(routing, experts, ~done[:, None], p + step - 1, e)
        else:
            logits, cache = layout.step(model, weights, token, pos, cache, p + step - 1, dtype)
        new, logp = sample(logits, keys, step, noise=noise_at(step))
        new = jnp.where(done, pad_id, new)
        logp = jnp.where(done, 0.0, logp)
        out_tok = jax.lax.dynamic_update_slice(out_tok, new[:, None], (0, step))
        out_lp = jax.lax.dynamic_update_slice(out_lp, logp[:, None], (0, step))
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | (new == eos_id)
        return step + 1, cache, new, pos + 1, out_tok, out_lp, done, lengths, routing

    carry = (jnp.int32(1), cache, token, pos, out_tok, out_lp, done, lengths, routing)
    _, cache, _, _, out_tok, out_lp, done, lengths, routing = jax.lax.while_loop(cond, body, carry)
    return out_tok, out_lp, lengths, done, cache, routing


class StaticSampler:
    """Compiles one generation program per (batch, prompt, new-token) bucket and settings.

    Weights are passed as state (not baked in as constants), so swapping weights never
    recompiles. `generate(model, ...)` splits the model on each call (~0.1 ms); callers
    that reuse one weight version may call `set_weights(model)` once and pass model=None.

    `mesh` (see tpu_jobs.model.mesh): weights are placed by `PARAM_RULES`, prompts and the KV
    cache split over data x fsdp (batch buckets rounded up to a multiple of that size).

    `kv_token_budget` (sampler.kv_token_budget): at most that many KV-cache token slots
    per generate program; a call over more runs in consecutive parts of at most
    `rows_per_call` rows (each row's tokens do not depend on the others'). 0: no bound.

    `decode_layout`: a name in `tpu_jobs.generate.decode_layouts.DECODE_LAYOUTS`; None picks the faster one
    for the model and the platform of the mesh (or the default device): feature_major on
    CPU for hidden sizes >= 256 (`tpu_jobs.generate.decode_layouts.default_layout`). feature_major keeps a
    transposed copy of the weights it last saw (as much memory again as the weights).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        pad_id: int = 0,
        eos_id: int = 2,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
        new_token_buckets: Sequence[int] = DEFAULT_NEW_TOKEN_BUCKETS,
        mesh: jax.sharding.Mesh | None = None,
        decode_layout: str | None = None,
        kv_token_budget: int = 0,
    ):
        for name, buckets in (
            ("batch_buckets", batch_buckets),
            ("prompt_buckets", prompt_buckets),
            ("new_token_buckets", new_token_buckets),
        ):
            if not buckets or any(int(b) <= 0 for b in buckets):
                raise ValueError(f"{name}={buckets!r} is invalid; allowed: positive integers")
        decode_layout = resolve_layout(decode_layout, cfg, mesh)
        self.decode_layout = decode_layout
        self._layout = DECODE_LAYOUTS[decode_layout]
        self.cfg = cfg
        self.pad_id, self.eos_id = int(pad_id), int(eos_id)
        self.batch_buckets = tuple(sorted(int(b) for b in batch_buckets))
        self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets))
        self.new_token_buckets = tuple(sorted(int(b) for b in new_token_buckets))
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self._caches: dict[tuple, KVCache] = {}  # donated in, returned out, reused
        # The decode layout's weights of the last weights seen: (dtype, their leaves, weights).
        self._prepared: tuple[str, list, object] | None = None
        self._weights: tuple[nnx.GraphDef, nnx.State] | None = None
        self.mesh = mesh
        if kv_token_budget < 0:
            raise ValueError(
                f"kv_token_budget={kv_token_budget} is invalid; allowed: >= 0 (0: no bound)"
            )
        self.kv_token_budget = int(kv_token_budget)

    @property
    def compile_count(self) -> int:
        """Number of programs compiled so far (one per bucket/settings combination)."""
        return len(self._compiled)

    def rows_per_call(self, n: int, length: int) -> int:
        """How many of `n` rows of `length` cache slots (prompt + new-token buckets) one
        generate program takes under the KV budget: all of them without one, else the
        largest batch bucket (a multiple of the mesh's data x fsdp) whose cache fits."""
        multiple = 1 if self.mesh is None else meshlib.batch_size_multiple(self.mesh)

        def padded(rows: int) -> int:
            return -(-bucket(rows, self.batch_buckets) // multiple) * multiple

        if not self.kv_token_budget or padded(n) * length <= self.kv_token_budget:
            return n
        fits = [
            b for b in self.batch_buckets if b < n and padded(b) * length <= self.kv_token_budget
        ]
        if not fits:
            raise ValueError(
                f"sampler.kv_token_budget={self.kv_token_budget} holds no generate program of "
                f"{padded(1)} row(s) x {length} cache slots (prompt + new-token buckets); "
                f"allowed: a budget of at least {padded(1) * length}, or fewer new tokens"
            )
        return max(fits)

    def set_weights(self, model: Transformer) -> None:
        """Split `model` once; later `generate(None, ...)` calls use these weights."""
        self._weights = nnx.split(model)

    def _split(self, model: Transformer | None) -> tuple[nnx.GraphDef, nnx.State, list]:
        """(graphdef, state placed on the mesh, the given state's leaves): the leaves
        identify the weights (`_prepared_weights`)."""
        if model is not None:
            graphdef, state = nnx.split(model)
        elif self._weights is not None:
            graphdef, state = self._weights
        else:
            raise ValueError("no weights: pass a model or call set_weights(model) first")
        given = jax.tree.leaves(state)
        if self.mesh is not None:  # a no-op for arrays already placed so
            state = meshlib.shard_tree(state, self.mesh)
        return graphdef, state, given

    def prepare_weights(self, model: Transformer | None = None, dtype: str = "float32") -> None:
        """Compute the decode layout's weights now (else the first `generate` with these
        weights does): a transposed copy of every kernel for feature_major."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is invalid; allowed: {', '.join(DTYPES)}")
        jax.block_until_ready(self._prepared_weights(*self._split(model), dtype))

    def _prepared_weights(self, graphdef, state, given: list, dtype: str):
        """(`prepare_state`'s cast state, the decode layout's weights) for `state`, recomputed
        only when the weights change (new arrays: a new version loaded, or another model)
        or the dtype does. For feature_major that is a transposed copy of every kernel
        (~0.3 s for 75M parameters on 2 cores), too slow to repeat for every batch of one
        version."""
        hit = self._prepared
        if hit is not None and hit[0] == dtype and same_arrays(hit[1], given):
            return hit[2]
        self._prepared = None  # free the old weights first
        weights = prepare_program(graphdef, self.decode_layout, dtype)(state)
        self._prepared = (dtype, given, weights)
        return weights

    def program(
        self, graphdef: nnx.GraphDef, n_new: int, dtype: str, use_top_k: bool, use_top_p: bool
    ) -> jax.stages.Wrapped:
        """The jitted generate program of one bucket's settings, taking (state, decode
        weights, tokens, mask, keys, cache, max_new, temperature, top_k, top_p); the KV
        cache is donated. `generate` compiles it per bucket; `tpu_jobs.learning.memory` lowers it
        for abstract inputs."""
        fn = functools.partial(
            _generate,
            graphdef,
            layout=self._layout,
            n_new=n_new,
            dtype=dtype,
            use_top_k=use_top_k,
            use_top_p=use_top_p,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
        )
        return jax.jit(fn, donate_argnums=(5,))

    def abstract_weights(self, graphdef: nnx.GraphDef, state: nnx.State, dtype: str):
        """The shapes of (the state, the decode layout's weights) a generate program of
        `dtype` takes for `state` (no computation)."""
        cast, weights = jax.eval_shape(prepare_program(graphdef, self.decode_layout, dtype), state)
        return (state if cast is None else cast), weights

    def generate(
        self,
        model: Transformer | None,
        prompts: list[list[int]],
        keys: jax.Array,
        params: SamplingParams,
    ) -> SampleResult:
        """Sample up to `params.max_new_tokens` tokens after each prompt (SampleResult)."""
        n = check_prompts(prompts, params.max_new_tokens, self.cfg.max_seq_len)
        max_new_tokens, temperature, dtype = params.max_new_tokens, params.temperature, params.dtype
        top_k, top_p = params.top_k, params.top_p
        typed_keys = as_keys(keys, n)
        pb = bucket(max(len(p) for p in prompts), self.prompt_buckets)
        nb = bucket(max_new_tokens, self.new_token_buckets)
        rows = self.rows_per_call(n, pb + nb)
        if rows < n:  # the KV budget: consecutive parts, each its own bounded program
            parts = [
                self.generate(
                    model,
                    prompts[i : i + rows],
                    typed_keys[i : i + rows],
                    params,
                )
                for i in range(0, n, rows)
            ]
            joined = {
                f.name: np.concatenate([getattr(r, f.name) for r in parts])
                for f in fields(SampleResult)
                if f.name != "routing"
            }
            routing = None if parts[0].routing is None else [x for r in parts for x in r.routing]
            return SampleResult(**joined, routing=routing)
        graphdef, state, given = self._split(model)

        bb = bucket(n, self.batch_buckets)
        if self.mesh is not None:
            multiple = meshlib.batch_size_multiple(self.mesh)
            bb = -(-bb // multiple) * multiple
        tokens = np.full((bb, pb), self.pad_id, np.int32)
        mask = np.zeros((bb, pb), np.int32)
        for i, prompt in enumerate(prompts):  # left padding
            tokens[i, pb - len(prompt) :] = prompt
            mask[i, pb - len(prompt) :] = 1
        tokens[n:], mask[n:] = tokens[0], mask[0]  # filler rows: copies of row 0, discarded
        if bb > n:
            typed_keys = jnp.concatenate([typed_keys, jnp.repeat(typed_keys[:1], bb - n)])

        use_top_k, use_top_p = top_k > 0, top_p < 1.0
        cache_key = (bb, pb + nb, dtype)
        cache = self._caches.pop(cache_key, None)
        if cache is None:
            cache = init_cache(self.cfg, bb, pb + nb, dtype, per_layer=True)
        tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
        if self.mesh is not None:
            tokens, mask, typed_keys = meshlib.shard_batch((tokens, mask, typed_keys), self.mesh)
            cache = jax.device_put(cache, meshlib.cache_sharding(self.mesh, cache))
        cast, weights = self._prepared_weights(graphdef, state, given, dtype)
        args = (
            state if cast is None else cast,
            weights,
            tokens,
            mask,
            typed_keys,
            cache,
            jnp.int32(max_new_tokens),
            jnp.float32(temperature),
            jnp.int32(top_k),
            jnp.float32(top_p),
        )
        key = (graphdef, bb, pb, nb, dtype, use_top_k, use_top_p, str(typed_keys.dtype))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.program(graphdef, nb, dtype, use_top_k, use_top_p)
            compiled = compiled.lower(*args).compile()
            self._compiled[key] = compiled
        out_tok, out_lp, lengths, done, cache, routing = compiled(*args)
        self._caches[cache_key] = cache
        to_host = jax.device_get if self.mesh is None else meshlib.to_host
        out_tok, out_lp, lengths, done, routing = to_host((out_tok, out_lp, lengths, done, routing))
        if routing is not None:  # each row's prompt and generated tokens (left padding off)
            routing = [
                np.asarray(routing[i, pb - len(prompt) : pb + int(lengths[i])])
                for i, prompt in enumerate(prompts)
            ]
        return SampleResult(
            tokens=np.asarray(out_tok[:n, :max_new_tokens], np.int32),
            logprobs=np.asarray(out_lp[:n, :max_new_tokens], np.float32),
            lengths=np.asarray(lengths[:n], np.int32),
            finished=np.asarray(done[:n], np.bool_),
            routing=routing,
        )
