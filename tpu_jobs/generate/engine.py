"""A continuous-batching rollout engine: a fixed number of slots over a paged KV cache,
decode in jitted chunks, refill between chunks, one prefill per prompt group, stop
sequences and resumable requests. The default sampler of every job that samples
(`tpu_jobs.generate.registry`); `tpu_jobs.generate.static_sampler.StaticSampler` (one
static batch until its longest row ends) is the reference it is tested against.

How a call runs (`Engine.run`; `Engine.generate` is the static sampler's interface):

* Requests wait in a FIFO queue. Fresh requests with the same prompt form a *group*
  (the G samples of a prompt): the prompt is prefilled once, into pages the group's
  members share (`tpu_jobs.generate.kv_pages`); each member copies only the prompt's last,
  partial page, which it goes on writing. The prefill runs the LM head at each row's
  last position only.
* Between decode chunks, free slots are refilled from the queue: one batched prefill
  (`_extend`) of the new groups and requests, then one program (`_admit`) that copies the
  partial pages and samples each admitted row's first token.
* A decode chunk (`_decode`) runs up to `chunk` steps of the live rows as one jitted
  program of static shape: rows padded up to a slot bucket (powers of 2), the block
  table up to a page bucket, so a chunk's cost follows the rows still running and their
  lengths, and each bucket compiles once (twice: see the next point). It gathers the
  rows' pages once, steps on the contiguous copy and writes the chunk's new keys/values
  back to the pages. A row that emits EOS or reaches its token limit stops writing (its
  writes go to the trash page); stop sequences are found on the host after the chunk,
  and the tokens after one are dropped.
* A chunk ends early, on the device, once its live rows fit the next smaller bucket (or
  none is left: `Engine._floor`), so that the rows left run the smaller bucket's cheaper
  program from the next step on instead of a chunk's worth of padding rows: at the 100m
  preset a decode step costs about its rows' matmuls from ~16 rows up.
* A chunk over the same rows and table width as the one before (no row admitted,
  preempted or resumed since) resumes from that chunk's copy of the rows' cache, the
  chunk's keys/values written into it, instead of gathering the pages again
  (`Engine.resident_rows`, on by default: at the 100m preset the gather is 8-13% of a
  64-row chunk of 4 pages and 17-28% of one of 16, benchmarks/results/engine-epyc*.md).
  With as many rows, rows that stopped stay as padding rows, so the others keep their
  place; with fewer (after an early end), the rows' copies are picked out of the last
  one (`_pick_rows`). The copy equals what the gather would give, so the bytes are the
  same either way.
* The steps run in the sampler's decode layout (`tpu_jobs.generate.decode_layouts`,
  `ROW_STEPS`): on CPU from hidden size 256, feature_major (q/k/v and gate/up fused,
  the batch the matmuls' minor dimension; the copy in the per-layer cache layout, read
  only, and the chunk's own keys in a small array of their own), else the model's own
  forward over the copy. At the 100m preset on 2 CPU cores a 64-row feature-major
  chunk takes about half the time (benchmarks/results/engine.md's profile).
* Pages are allocated as rows grow. When the pool (the token budget) runs out, the
  most recently admitted row is preempted: its pages are freed and it is queued again
  with its whole history, to be prefilled when pages are free (recompute, as vLLM
  does). A request that cannot fit the budget on its own is refused up front.
* `keep=True` parks a finished request with its pages; `Resume(handle, tokens)` appends
  tokens (a tool's output) and continues from its cache.
* `Engine.stream` takes requests as a `feed` callback hands them over (asked whenever
  everything fed is admitted and a slot is free) and reports each completion as it
  finishes: a rollout worker's in-flight batches (`tpu_jobs.generate.inflight`). `run` is
  a stream with one feed.

Reproducibility. Row r's token at sample index s is argmax(filtered logits +
gumbel(fold_in(key_r, s))), the static sampler's draw, and its logits depend only on its
own tokens (attention reads only its own pages). So a row's tokens depend on its key, its
prompt and the weights, not on its slot, its chunk's other rows, or preemptions, up to
float rounding between shape buckets (as for the static sampler), which on the tests'
models leaves the tokens identical. The schedule itself is a deterministic function of
the requests, so a batch is the same however often it is made (on one machine kind);
with `stream` it depends on when the feed hands requests over, so a row's log-probs
can change in their last bits (benchmarks/results/row_invariance.md).
"""

from __future__ import annotations

import functools
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipeline.config import ModelConfig
from pipeline.rollouts import routing_dtype
from tpu_jobs.generate.decode_layouts import (
    feature_major_logits,
    prepare_program,
    resolve_layout,
)
from tpu_jobs.generate.interface import SampleResult, SamplingParams, check_prompts
from tpu_jobs.generate.kv_pages import (
    PAGED_ATTENTION,
    PagedKV,
    PagedLayer,
    PagePool,
    PoolExhausted,
    RowsLayer,
    copy_pages,
    gather_rows,
    gather_rows_split,
    init_pages,
    page_bytes,
    scatter_rows,
    scatter_tokens,
)
from tpu_jobs.generate.token_draw import NOISE_BUDGET, as_keys, key_data, sample_step
from tpu_jobs.generate.weight_copies import same_arrays
from tpu_jobs.model import mesh as meshlib
from tpu_jobs.model.batching import DEFAULT_PROMPT_BUCKETS, bucket
from tpu_jobs.model.transformer import DTYPES, Transformer, decode_attention, rope_tables

STOP_REASONS = ("eos", "stop", "length")


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Request:
    """Sample up to `max_new_tokens` tokens after `prompt` with `key` (a typed PRNG key
    or uint32 key data [2]). The token of sample index s uses fold_in(key, s), s from
    `first_step`. Stops at EOS, at the token limit, or after any of `stop` (token
    sequences) or `stop_strings` (needs the engine's `detokenize`); the stop tokens are
    part of the completion. `keep`: park the request with its cache when it stops, so a
    `Resume` can continue it."""

    prompt: Sequence[int]
    key: jax.Array | np.ndarray
    max_new_tokens: int
    stop: Sequence[Sequence[int]] = ()
    stop_strings: Sequence[str] = ()
    first_step: int = 0
    keep: bool = False


@dataclass(frozen=True)
class Resume:
    """Continue parked request `handle`: append `tokens` (e.g. a tool's output; not
    sampled, no log-probs) and sample up to `max_new_tokens` more, continuing the
    request's sample indices. Same stop rules as `Request`."""

    handle: int
    tokens: Sequence[int]
    max_new_tokens: int
    stop: Sequence[Sequence[int]] = ()
    stop_strings: Sequence[str] = ()
    keep: bool = False


@dataclass
class Completion:
    """One request's (or turn's) sampled tokens and their log-probs; `stop_reason` in
    STOP_REASONS; `handle` when parked (resumable), else None."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    handle: int | None = None
    # MoE models: [history tokens - 1, layers, k], the experts of every token the engine
    # fed (the request's whole history: prompt, earlier turns, these tokens but the last);
    # None for dense models.
    routing: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        """Ended by EOS or a stop sequence (not by the token limit)."""
        return self.stop_reason != "length"


@dataclass(eq=False)
class _Seq:
    """A request in flight. Invariant while it holds a slot: the KV of history[:cached]
    is in its pages, and history[-1] (its last sampled token) is the next to feed."""

    index: int
    key: np.ndarray  # uint32 key data
    history: list[int]
    left: int  # tokens it may still sample
    step: int  # sample index of its next token
    stop: tuple[tuple[int, ...], ...]
    stop_strings: tuple[str, ...]
    keep: bool
    pages: list[int] = field(default_factory=list)
    cached: int = 0
    out: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    reason: str | None = None
    group: _Group | None = None
    logits: jax.Array | None = None  # [V] after its prefill, until its first token
    handle: int | None = None  # while parked
    # MoE models: the experts [layers, k] the routers chose for each history token fed so
    # far (all but the last sampled one), for routing replay; empty for dense models.
    routing: list[np.ndarray] = field(default_factory=list)


@dataclass(frozen=True)
class _LastChunk:
    """The last decode chunk's rows in program order (None: a padding row), its (rows,
    table pages) shape and its rows' cache copy (None unless `Engine.resident_rows`)."""

    rows: list
    shape: tuple[int, int]
    copy: tuple | None


@dataclass(eq=False)
class _Group:
    """Fresh requests sharing one prompt: prefilled once into `pages` (full pages, shared,
    plus the partial last page as a template each member copies)."""

    prompt: list[int]
    members: deque
    pages: list[int] = field(default_factory=list)
    logits: jax.Array | None = None  # [V] at the prompt's last position
    routing: list[np.ndarray] = field(default_factory=list)  # the prompt's (MoE), as _Seq's


def _key_data(key: jax.Array | np.ndarray) -> np.ndarray:
    """uint32 key data [2] of a typed PRNG key or of key data."""
    data = key_data(key)
    if data.dtype != np.uint32 or data.shape != (2,):
        raise ValueError(
            f"a request key of dtype {data.dtype} and shape {data.shape} is invalid; allowed: "
            "a typed PRNG key (jax.random.key) or uint32 key data of shape [2]"
        )
    return data


def _check_request(i: int, r: Request | Resume, detokenize) -> None:
    if r.max_new_tokens <= 0:
        raise ValueError(f"request {i}: max_new_tokens={r.max_new_tokens}; allowed: > 0")
    if isinstance(r, Request) and len(r.prompt) == 0:
        raise ValueError(f"request {i}: empty prompt; allowed: >= 1 token")
    if any(len(s) == 0 for s in r.stop) or any(not s for s in r.stop_strings):
        raise ValueError(f"request {i}: an empty stop sequence; allowed: non-empty ones")
    if r.stop_strings and detokenize is None:
        raise ValueError(f"request {i} has stop_strings, but the engine has no detokenize")


# --------------------------------------------------------------------------- programs


def _row_noise(keys: jax.Array, steps: jax.Array, vocab: int) -> jax.Array:
    """[B, V]: gumbel(fold_in(keys[r], steps[r])), as `token_draw.step_noise` per row."""
    return jax.vmap(lambda k, s: jax.random.gumbel(jax.random.fold_in(k, s), (vocab,)))(keys, steps)


def _chunk_noise(keys: jax.Array, steps: jax.Array, n: int, vocab: int) -> jax.Array:
    """[B, n, V]: row r's noise for sample indices steps[r] .. steps[r] + n - 1."""
    offsets = jnp.arange(n, dtype=jnp.int32)

    def row(key, first):
        return jax.vmap(lambda o: jax.random.gumbel(jax.random.fold_in(key, first + o), (vocab,)))(
            offsets
        )

    return jax.vmap(row)(keys, steps)


def paged_hidden(
    model: Transformer,
    tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    pages: PagedKV,
    table: jax.Array,
    dtype: str,
    attention: str = "gather",
) -> tuple[jax.Array, PagedKV, jax.Array | None]:
    """The model's final hidden states [B, T, H] of `tokens` [B, T] at `positions`, each
    row attending over its pages (`table` [B, P]); the tokens' keys/values are written
    to their pages, invalid ones (`valid` False) to the trash page; and the experts
    [layers, B, T, k] the MoE routers chose (None for a dense model)."""
    size = pages.page_size
    rows = jnp.arange(tokens.shape[0])[:, None]
    page_index = jnp.minimum(positions // size, table.shape[1] - 1)
    write_page = jnp.where(valid, table[rows, page_index], pages.trash)
    write_offset = jnp.where(valid, positions % size, 0)
    return _layers(
        model,
        tokens,
        positions,
        pages,
        lambda k, v: PagedLayer(k, v, table, positions, write_page, write_offset, attention),
        dtype,
    )


def _layers(model, tokens, positions, kv: PagedKV, view, dtype):
    """The model's layers over tokens [B, T], each attending through `view(k, v)` of its
    layer's keys/values in `kv` (tpu_jobs.generate.kv_pages); (final hidden states, new
    kv, the MoE routers' experts [layers, B, T, k] or None for a dense model)."""
    x = model.embed_tokens(tokens).astype(DTYPES[dtype])
    cos, sin = rope_tables(positions, model.cfg.head_dim, model.cfg.rope_theta)
    ks, vs = list(kv.k), list(kv.v)
    experts = []
    for i, layer in enumerate(model.layers):
        x, (ks[i], vs[i]), router = layer.forward(x, cos, sin, None, view(ks[i], vs[i]))
        experts.append(None if router is None else router.experts)
    routing = jnp.stack(experts) if model.cfg.moe else None
    return model.norm(x), PagedKV(k=tuple(ks), v=tuple(vs)), routing


def _extend(graphdef, state, pages, tokens, start, count, table, *, dtype, attention):
    """Feed tokens [B, T] (row b: its first count[b], at positions start[b]..) and return
    (float32 logits [B, V] at each row's last fed token, pages, the fed tokens' experts
    [layers, B, T, k] or None)."""
    model = nnx.merge(graphdef, state)
    offsets = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    positions = start[:, None] + offsets[None]
    valid = offsets[None] < count[:, None]
    hidden, pages, routing = paged_hidden(
        model, tokens, positions, valid, pages, table, dtype, attention
    )
    last = jnp.maximum(count - 1, 0)[:, None, None]
    return model.logits(jnp.take_along_axis(hidden, last, axis=1)[:, 0]), pages, routing


def _admit(pages, src, dst, logits, keys, steps, temperature, top_k, top_p, **flags):
    """Copy pages src -> dst (the members' partial prompt pages) and sample each admitted
    row's first token from its prompt's logits: (tokens [A], log-probs [A], pages)."""
    pages = copy_pages(pages, src, dst)
    noise = _row_noise(keys, steps, logits.shape[-1])
    token, logp = sample_step(logits, keys, 0, temperature, top_k, top_p, noise=noise, **flags)
    return token, logp, pages


@dataclass(frozen=True)
class _RowSteps:
    """How a decode chunk holds its rows' keys/values (one per decode layout):
    begin(pages, table, n_steps) -> (what the steps read, what they carry);
    resume(read, carry, positions [B, C], valid [B, C], n_steps) -> (read, carry): the
        next chunk's, from the end of a chunk over the same rows, equal to what `begin`
        would gather from the pages then (the chunk's keys/values at their positions);
    step(model, weights, read, carry, token, pos, start, c, dtype) -> (float32 logits
        [B, V], carry, the MoE routers' experts [layers, B, 1, k] or None);
    end(pages, read, carry, table, positions [B, C], valid [B, C]) -> pages."""

    begin: Callable
    resume: Callable
    step: Callable
    end: Callable


def _token_major_step(model, weights, read, rows, token, pos, start, c, dtype):
    """The model's own layers over rows [B, L, kv, hd] (`gather_rows`), each step writing
    its token's keys/values into the copy."""
    hidden, rows, routing = _layers(
        model,
        token[:, None],
        pos[:, None],
        rows,
        lambda k, v: RowsLayer(k, v, pos[:, None]),
        dtype,
    )
    return model.logits(hidden[:, 0]), rows, routing


def _feature_major_begin(pages, table, n_steps):
    """The rows' cache in the per-layer layout, read-only for the chunk, and per layer
    the chunk's own keys [B, kv, hd, C] and values [B, kv, C, hd], written at step c.
    Both float32, which decode attention computes in: a bfloat16 cache is widened once per
    chunk (exactly), not at every step of every layer (that convert cost more than the
    bfloat16 matmuls saved: 100m preset, 64 rows)."""
    old = gather_rows_split(pages, table)
    old = PagedKV(*(tuple(a.astype(jnp.float32) for a in part) for part in (old.k, old.v)))
    return old, _chunk_arrays(old, n_steps)


def _chunk_arrays(old: PagedKV, n_steps: int) -> PagedKV:
    """Empty per-layer arrays for a chunk's own keys [B, kv, hd, C] and values [B, kv, C,
    hd], in the dtype of the rows' copy `old`."""
    b, nkv, hd = old.k[0].shape[:3]
    k = jnp.zeros((b, nkv, hd, n_steps), old.k[0].dtype)
    v = jnp.zeros((b, nkv, n_steps, hd), old.v[0].dtype)
    return PagedKV(k=(k,) * len(old.k), v=(v,) * len(old.v))


def _chunk_tokens(new: PagedKV) -> tuple[Iterator[jax.Array], Iterator[jax.Array]]:
    """A chunk's own keys and values per layer as [B, C, kv, hd] (token major)."""
    return (a.transpose(0, 3, 1, 2) for a in new.k), (a.transpose(0, 2, 1, 3) for a in new.v)


def _feature_major_resume(old, new, positions, valid, n_steps):
    """The last chunk's keys/values written into the rows' copy at their positions (a
    stopped row's later steps dropped, as `_feature_major_end` drops them from the
    pages), and empty arrays for the next chunk's. In place: the copy is donated."""
    at = jnp.where(valid, positions, old.k[0].shape[-1])  # out of range: dropped
    index = jnp.arange(at.shape[0])[:, None]
    keys, values = _chunk_tokens(new)
    k = tuple(a.at[index, :, :, at].set(n, mode="drop") for a, n in zip(old.k, keys, strict=True))
    v = tuple(a.at[index, :, at, :].set(n, mode="drop") for a, n in zip(old.v, values, strict=True))
    return PagedKV(k=k, v=v), _chunk_arrays(old, n_steps)


def _feature_major_step(model, weights, old, new, token, pos, start, c, dtype):
    """The feature-major layers (tpu_jobs.generate.decode_layouts): attention over the
    cache before the chunk (positions < start) and the chunk's keys so far (steps <= c),
    one softmax over both. A step writes one column of the small per-chunk arrays (the
    same column for every row) instead of a row-indexed scatter into the cache copy,
    which cost about as much as the attention itself (100m preset, 64 rows)."""
    ks, vs = list(new.k), list(new.v)
    seen = jnp.arange(old.k[0].shape[-1], dtype=jnp.int32)[None, :] < start[:, None]
    mine = jnp.arange(ks[0].shape[-1], dtype=jnp.int32) <= c

    def attend(i, att, q, k, v):
        k, v = k.astype(ks[i].dtype), v.astype(vs[i].dtype)
        ks[i] = jax.lax.dynamic_update_slice_in_dim(ks[i], k[:, 0, :, :, None], c, axis=3)
        vs[i] = jax.lax.dynamic_update_slice_in_dim(vs[i], v[:, 0, :, None], c, axis=2)
        parts = [(old.k[i], old.v[i], seen[:, None, None]), (ks[i], vs[i], mine)]
        return decode_attention(q, att.num_kv_heads, parts)

    logits = feature_major_logits(model, weights, token, pos, dtype, attend)
    return logits, PagedKV(k=tuple(ks), v=tuple(vs)), None


def _feature_major_end(pages, old, new, table, positions, valid):
    """Write the chunk's keys/values ([B, C, kv, hd] each) to their pages."""
    return scatter_tokens(pages, *_chunk_tokens(new), table, positions, valid)


# decode_layout -> how a decode chunk steps over its rows.
ROW_STEPS: dict[str, _RowSteps] = {
    "token_major": _RowSteps(
        begin=lambda pages, table, n_steps: (None, gather_rows(pages, table)),
        # The rows' copy already holds the chunk's keys/values (`RowsLayer` wrote them).
        resume=lambda read, rows, positions, valid, n_steps: (read, rows),
        step=_token_major_step,
        end=lambda pages, read, rows, *args: scatter_rows(pages, rows, *args),
    ),
    "feature_major": _RowSteps(
        begin=_feature_major_begin,
        resume=_feature_major_resume,
        step=_feature_major_step,
        end=_feature_major_end,
    ),
}


def _decode(
    graphdef,
    state,
    weights,
    pages,
    resident,
    token,
    pos,
    step,
    keys,
    left,
    floor,
    table,
    temperature,
    top_k,
    top_p,
    *,
    n_steps: int,
    dtype: str,
    layout: str,
    use_top_k: bool,
    use_top_p: bool,
    eos_id: int,
    pad_id: int,
):
    """Up to `n_steps` decode steps of rows [R]: feed token (at pos), sample the next
    with sample index `step`, while the row is live (left > 0, no EOS yet). The chunk ends
    early once at most `floor` rows are live (a smaller row bucket's worth, or none: the
    host's `_floor`); the steps it did not run emit nothing. `weights`: the
    decode layout's (`decode_layouts`; None for token_major). Returns (tokens, log-probs,
    emitted flags, each [R, n_steps], pages, the fed tokens' experts [n_steps, layers, R,
    k] or None for a dense model, the rows' copy at the end: `resident` for a next chunk
    over the same rows). `resident`: None (gather the rows' pages) or the copy a chunk
    over the same rows in the same order and shapes returned, or `_pick_rows` of one
    (donated)."""
    model = nnx.merge(graphdef, state)
    vocab = model.cfg.vocab_size
    rows = ROW_STEPS[layout]
    sample = functools.partial(
        sample_step,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        use_top_k=use_top_k,
        use_top_p=use_top_p,
    )
    noise_all = None
    if token.shape[0] * n_steps * vocab <= NOISE_BUDGET:
        # Live rows' sample indices run step .. step + n_steps - 1: one vectorised draw.
        noise_all = jax.lax.optimization_barrier(_chunk_noise(keys, step, n_steps, vocab))

    # The rows' pages gathered once per chunk into contiguous copies (`ROW_STEPS`); the
    # chunk's new keys/values are written back to the pages at the end. Gathering at
    # every step copied the rows' whole cache per step (~2x the step).
    start = pos
    if resident is None:
        read, held = rows.begin(pages, table, n_steps)
    else:
        read, held = rows.resume(*resident, n_steps)

    def body(carry):
        c, held, token, pos, step, left, live, out = carry
        logits, held, routing = rows.step(model, weights, read, held, token, pos, start, c, dtype)
        noise = _row_noise(keys, step, vocab) if noise_all is None else noise_all[:, c]
        new, logp = sample(logits, keys, 0, noise=noise)
        new = jnp.where(live, new, pad_id)
        logp = jnp.where(live, logp, 0.0)
        inc = live.astype(jnp.int32)
        left = left - inc
        fed = None if routing is None else routing[:, :, 0]
        out = jax.tree.map(lambda buf, x: buf.at[c].set(x), out, (new, logp, live, fed))
        token = jnp.where(live, new, token)
        live = live & (new != eos_id) & (left > 0)
        return c + 1, held, token, pos + inc, step + inc, left, live, out

    def more(carry):
        c, live = carry[0], carry[6]
        return (c < n_steps) & (jnp.sum(live.astype(jnp.int32)) > floor)

    # A step's outputs by step; the steps an early end skips keep these (nothing emitted).
    r = token.shape[0]
    routed = jax.eval_shape(
        lambda h: rows.step(model, weights, read, h, token, pos, start, 0, dtype)[2], held
    )  # [layers, R, 1, k] or None
    out = (
        jnp.full((n_steps, r), pad_id, jnp.int32),
        jnp.zeros((n_steps, r), jnp.float32),
        jnp.zeros((n_steps, r), bool),
        None
        if routed is None
        else jnp.zeros((n_steps, *routed.shape[:2], *routed.shape[3:]), routed.dtype),
    )
    init = (jnp.int32(0), held, token, pos, step, left, left > 0, out)
    carry = jax.lax.while_loop(more, body, init)
    tokens, logps, emitted, routing = carry[-1]
    written = start[:, None] + jnp.arange(n_steps, dtype=jnp.int32)[None]  # fed at step c
    pages = rows.end(pages, read, carry[1], table, written, emitted.T)
    return tokens.T, logps.T, emitted.T, pages, routing, (read, carry[1], written, emitted.T)


# --------------------------------------------------------------------------- engine


def steps_run(emitted: np.ndarray) -> int:
    """The steps a decode chunk ran, from its emitted flags [R, chunk]: every step it ran
    had a live row (it ends early otherwise), and the steps it skipped emit nothing."""
    return int(emitted.any(axis=0).sum())


def _pick_rows(copy: tuple, picks: jax.Array) -> tuple:
    """Rows `picks` [R] of a chunk's copy of its rows' cache (`_decode`'s last output):
    a chunk of fewer rows over the same table width resumes from them. A copy of the
    rows' contiguous cache, cheaper than gathering (and transposing) their pages."""
    return jax.tree.map(lambda a: jnp.take(a, picks, axis=0), copy)


def _powers(base: int, top: int) -> tuple[int, ...]:
    """1, base, base^2, ... below `top`, then `top`."""
    out, b = [], 1
    while b < top:
        out.append(b)
        b *= base
    return (*out, top)


# Block-table widths (pages) that compile: powers of two, so attention reads at most
# twice the pages of the longest live row.
PAGE_BUCKETS = _powers(2, 1 << 20)
MIN_WIDTH = 64  # tokens: the narrowest block table a decode chunk compiles for
# Jitted programs by (function, graphdef, mesh, static settings), shared by the engines of
# a process: another Engine of the same model and settings compiles nothing new.
_PROGRAMS: dict[tuple, Callable] = {}


class Engine:
    """Continuous batching over `max_slots` slots and a paged KV cache (module docstring).

    `kv_tokens`: the token budget of the page pool (rounded down to whole pages); None:
    max_slots rows of the model's max_seq_len (and a page each), so that no row is ever
    preempted. `row_buckets`: the row counts a chunk or prefill compiles for (None: powers
    of 2 from 4 up to max_slots). `chunk`: the most decode steps a jitted chunk runs (more:
    fewer host round trips; fewer: less work past a row's end when a chunk does not end
    early). `detokenize`: token ids -> text, needed for `stop_strings`. `mesh`: weights are
    placed by the mesh's rules and the pool is replicated on it (the slots are not split
    over the data axis yet, docs/scaling.md). `check`: verify the pool's reference counts
    against the rows after every chunk (tests). `decode_layout`: the decode steps' layout
    (`tpu_jobs.generate.decode_layouts`; None: the platform's default, feature_major on CPU
    for hidden sizes >= 256, as the static sampler). `resident_rows`: keep a chunk's copy of
    its rows' cache for the next chunk over the same rows (`_arrange`) instead of gathering
    it from the pages again; the same bytes either way, the copy's memory (the live rows'
    cache) held between chunks. `profile`: wait for each prefill to finish before the next
    phase, so that `stats`' seconds per phase are each phase's own (otherwise a prefill's
    device time shows up in the admission that reads its logits)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        pad_id: int = 0,
        eos_id: int = 2,
        max_slots: int = 64,
        kv_tokens: int | None = None,
        page_size: int = 16,
        chunk: int = 8,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
        row_buckets: Sequence[int] | None = None,
        attention: str = "gather",
        detokenize: Callable[[list[int]], str] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        check: bool = False,
        profile: bool = False,
        decode_layout: str | None = None,
        resident_rows: bool = True,
    ):
        for name, value in (("max_slots", max_slots), ("page_size", page_size), ("chunk", chunk)):
            if int(value) <= 0:
                raise ValueError(f"{name}={value} is invalid; allowed: a positive integer")
        if kv_tokens is not None and kv_tokens < page_size:
            raise ValueError(
                f"kv_tokens={kv_tokens} is invalid; allowed: None (sized per call) or at "
                f"least one page ({page_size} tokens)"
            )
        if attention not in PAGED_ATTENTION:
            raise ValueError(
                f"attention={attention!r} is invalid; allowed: "
                + ", ".join(map(repr, PAGED_ATTENTION))
            )
        self.cfg = cfg
        self.pad_id, self.eos_id = int(pad_id), int(eos_id)
        self.max_slots, self.page_size, self.chunk = int(max_slots), int(page_size), int(chunk)
        # The pool's size is fixed: its shape is part of every program's.
        self.kv_tokens = kv_tokens or max_slots * (cfg.max_seq_len + page_size)
        self.num_pages = self.kv_tokens // self.page_size
        self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets))
        # Rows of a chunk or a prefill: powers of 2 from 4 up to max_slots (a chunk of 17
        # live rows runs 32). At the 100m preset a decode step costs about its rows'
        # matmuls, so padding is paid in full: powers of 4 ran the long tail's 17-row
        # chunks as 64 rows. Each bucket compiles once per table width.
        default_rows = tuple(b for b in _powers(2, self.max_slots) if b >= min(4, self.max_slots))
        self.slot_buckets = tuple(sorted(row_buckets or default_rows))
        if self.slot_buckets[-1] < self.max_slots or self.slot_buckets[0] <= 0:
            raise ValueError(
                f"row_buckets={row_buckets!r} is invalid; allowed: positive sizes, the "
                f"largest at least max_slots={max_slots}"
            )
        self.attention = attention
        self.decode_layout = resolve_layout(decode_layout, cfg, mesh)
        self.platform = meshlib.platform_of(mesh)  # the page pool's storage (kv_pages.PACKED_PAGES)
        self.detokenize = detokenize
        self.mesh = mesh
        self.check = check
        self.profile = profile
        self.resident_rows = bool(resident_rows)
        self._last: _LastChunk | None = None  # the last decode chunk (`_arrange`)
        self.pool: PagePool | None = None
        self.pages: PagedKV | None = None
        self._pages_key: tuple | None = None
        self._parked: dict[int, _Seq] = {}
        self._next_handle = 0
        self._weights: tuple | None = None  # (dtype, given leaves, graphdef, state)
        self._programs: dict[tuple, Callable] = {}  # the ones this engine used
        # The last `run`'s counters (tokens, row-steps, chunks, pages) and its wall seconds
        # per phase: prefill, admission and decode programs (dispatch, device time and
        # the fetch of their results) and the host's own scheduling, the rest.
        self.stats: dict[str, float] = {}
        # The last run's decode chunks by (rows, block-table pages) bucket.
        self.chunk_shapes: Counter = Counter()

    # ----------------------------------------------------------------- plumbing

    def _program(
        self, fn: Callable, donate: int | tuple[int, ...], graphdef=None, **static
    ) -> Callable:
        """The jitted `fn` (with the model's graphdef bound first, if given) for these
        static settings; `donate`: the indices of the arguments updated in place."""
        fast = (fn.__name__, *sorted(static.items()))  # this call's graphdef: hashing it is slow
        if fast in self._run["programs"]:
            return self._run["programs"][fast]
        key = (fn.__name__, graphdef, self.mesh, *sorted(static.items()))
        if key not in _PROGRAMS:
            bound = fn if graphdef is None else functools.partial(fn, graphdef)
            _PROGRAMS[key] = jax.jit(functools.partial(bound, **static), donate_argnums=donate)
        self._programs[key] = self._run["programs"][fast] = _PROGRAMS[key]
        return self._programs[key]

    @property
    def compile_count(self) -> int:
        """Programs compiled so far for the settings this engine used (one per bucket)."""
        return sum(p._cache_size() for p in self._programs.values())

    def _state(self, model: Transformer, dtype: str) -> tuple[nnx.GraphDef, nnx.State, object]:
        """The weights in the compute dtype, placed on the mesh, and the decode layout's
        (`decode_layouts`; None for token_major); made once per weight version (new
        arrays) and dtype."""
        graphdef, state = nnx.split(model)
        given = jax.tree.leaves(state)
        hit = self._weights
        if hit is not None and hit[0] == dtype and same_arrays(hit[1], given):
            return hit[2], hit[3], hit[4]
        self._weights = None
        if self.mesh is not None:
            state = meshlib.shard_tree(state, self.mesh)
        cast, weights = prepare_program(graphdef, self.decode_layout, dtype)(state)
        state = state if cast is None else cast
        self._weights = (dtype, given, graphdef, state, weights)
        return graphdef, state, weights

    def _put(self, x):
        """Host arrays onto the engine's device(s): replicated on the mesh, if any."""
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(
            x, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        )

    def _pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def _ensure_pool(self, num_pages: int, dtype: str) -> None:
        key = (num_pages, dtype)
        if self._pages_key == key:
            return
        if self._parked:
            raise ValueError(
                "the page pool cannot change size or dtype while requests are parked; "
                f"release handles {sorted(self._parked)} first (or keep dtype and kv_tokens)"
            )
        self.pages = None  # free the old pool first
        pages = init_pages(self.cfg, num_pages, self.page_size, dtype, self.platform)
        self.pages = pages if self.mesh is None else self._put(pages)
        self.pool = PagePool(num_pages)
        self._pages_key = key

    @property
    def page_bytes(self) -> int:
        dtype = self._pages_key[1] if self._pages_key else "float32"
        return page_bytes(self.cfg, self.page_size, dtype)

    def release(self, handle: int) -> None:
        """Free a parked request's pages."""
        seq = self._parked.pop(handle, None)
        if seq is None:
            raise ValueError(f"handle {handle} is not parked; parked: {sorted(self._parked)}")
        self.pool.release(seq.pages)

    # ----------------------------------------------------------------- the sampler's interface

    def generate(
        self,
        model: Transformer,
        prompts: list[list[int]],
        keys: jax.Array,
        params: SamplingParams,
    ) -> SampleResult:
        """The `tpu_jobs.generate.interface.Sampler` contract, through `run`."""
        n = check_prompts(prompts, params.max_new_tokens, self.cfg.max_seq_len)
        max_new_tokens = params.max_new_tokens
        data = np.asarray(jax.random.key_data(as_keys(keys, n)))
        done = self.run(
            model, [Request(p, data[i], max_new_tokens) for i, p in enumerate(prompts)], params
        )
        return self.result(done, max_new_tokens)

    def result(self, done: Sequence[Completion], max_new_tokens: int) -> SampleResult:
        """Completions as the sampler interface returns them: padded to `max_new_tokens`
        with the routing record of each row (MoE)."""
        n = len(done)
        tokens = np.full((n, max_new_tokens), self.pad_id, np.int32)
        logprobs = np.zeros((n, max_new_tokens), np.float32)
        for i, c in enumerate(done):
            tokens[i, : len(c.tokens)] = c.tokens
            logprobs[i, : len(c.logprobs)] = c.logprobs
        return SampleResult(
            tokens=tokens,
            logprobs=logprobs,
            lengths=np.asarray([len(c.tokens) for c in done], np.int32),
            finished=np.asarray([c.stop_reason == "eos" for c in done], np.bool_),
            routing=None if done[0].routing is None else [self._record(c) for c in done],
        )

    def _record(self, c: Completion) -> np.ndarray:
        """A completion's routing record (`SampleResult.routing`): its fed tokens' experts
        and the not-recorded mark E for the last token, which was never fed."""
        e = self.cfg.num_experts
        dtype = routing_dtype(e)
        last = np.full((1, *c.routing.shape[1:]), e, dtype)
        return np.concatenate([c.routing.astype(dtype), last])

    # ----------------------------------------------------------------- requests -> rows

    def _seqs(
        self, requests: Sequence[Request | Resume], params: SamplingParams, first: int = 0
    ) -> list[_Seq]:
        """One _Seq per request, numbered from `first` (a Resume takes its parked one),
        once every request is checked and the pool sized."""
        needs = []
        for i, r in enumerate(requests, first):
            _check_request(i, r, self.detokenize)
            if r.max_new_tokens > params.max_new_tokens:
                raise ValueError(
                    f"request {i}: max_new_tokens={r.max_new_tokens} is invalid; allowed: "
                    f"<= params.max_new_tokens={params.max_new_tokens}"
                )
            base = (
                len(r.prompt)
                if isinstance(r, Request)
                else len(self._parked_seq(r.handle).history) + len(r.tokens)
            )
            needs.append(base + r.max_new_tokens)
        handles = [r.handle for r in requests if isinstance(r, Resume)]
        if len(set(handles)) != len(handles):
            raise ValueError(f"a handle is resumed twice in one call: {sorted(handles)}")
        num_pages = self.num_pages
        for i, need in enumerate(needs, first):
            if self._pages_for(need) + 1 > num_pages:
                raise ValueError(
                    f"request {i} needs {need} tokens of KV cache (its history + "
                    f"max_new_tokens), more than the budget of {num_pages * self.page_size} "
                    f"tokens ({num_pages} pages of {self.page_size}, one kept for sharing); "
                    "raise kv_tokens or shorten the request"
                )
        self._ensure_pool(num_pages, params.dtype)
        seqs = []
        for i, r in enumerate(requests, first):
            stop = tuple(tuple(int(t) for t in s) for s in r.stop)
            if isinstance(r, Resume):
                seq = self._parked.pop(r.handle)
                seq.history = seq.history + [int(t) for t in r.tokens]
                seq.index, seq.left, seq.keep, seq.reason = i, r.max_new_tokens, r.keep, None
                seq.stop, seq.stop_strings = stop, tuple(r.stop_strings)
                seq.out, seq.logps, seq.handle = [], [], None
            else:
                seq = _Seq(
                    index=i,
                    key=_key_data(r.key),
                    history=[int(t) for t in r.prompt],
                    left=r.max_new_tokens,
                    step=r.first_step,
                    stop=stop,
                    stop_strings=tuple(r.stop_strings),
                    keep=r.keep,
                )
            seqs.append(seq)
        return seqs

    def _parked_seq(self, handle: int) -> _Seq:
        if handle not in self._parked:
            raise ValueError(f"handle {handle} is not parked; parked: {sorted(self._parked)}")
        return self._parked[handle]

    # ----------------------------------------------------------------- the loop

    def run(
        self,
        model: Transformer,
        requests: Sequence[Request | Resume],
        params: SamplingParams | None = None,
    ) -> list[Completion]:
        """Serve `requests` to the end, sampling with `params` (None: the defaults); one
        Completion per request, in order. Each request's own `max_new_tokens` is its limit
        (a tool episode's turn: what is left of the episode), at most `params.max_new_tokens`."""
        if not requests:
            return []
        longest = max(r.max_new_tokens for r in requests)
        params = params or SamplingParams(max(longest, 1))
        out: list[Completion | None] = [None] * len(requests)
        feeds = iter([requests])
        self.stream(model, params, lambda: next(feeds, ()), out.__setitem__)
        return out  # type: ignore[return-value]  (every index was set by on_done)

    def stream(
        self,
        model: Transformer,
        params: SamplingParams,
        feed: Callable[[], Sequence[Request | Resume]],
        on_done: Callable[[int, Completion], None],
    ) -> int:
        """Serve requests as `feed` hands them over, until it hands none and every row is
        done; returns how many were served.

        `feed()` is called first, then whenever every request it gave is admitted and a
        slot is free: what it returns joins the queue (an empty answer: nothing now; ask
        again later). Requests are numbered in the order fed, from 0 over the whole call,
        and `on_done(index, completion)` is called as each one finishes, while the others
        decode: a caller can finish a whole group of its requests (a rollout batch)
        before the rest (`rollout.inflight_batches`). A row's log-probs can change in the
        last bits with the rows beside it (benchmarks/results/row_invariance.md)."""
        first = feed()
        if not first:
            return 0
        # Checked (and the pool sized) before the weights are converted.
        seqs = self._seqs(first, params)
        graphdef, state, weights = self._state(model, params.dtype)
        self._run = dict(
            graphdef=graphdef,
            state=state,
            weights=weights,
            dtype=params.dtype,
            sampling=(
                jnp.float32(params.temperature),
                jnp.int32(params.top_k),
                jnp.float32(params.top_p),
            ),
            flags=dict(use_top_k=params.top_k > 0, use_top_p=params.top_p < 1.0),
            programs={},
        )
        began = time.perf_counter()
        self.stats = dict(
            prefill_rows=0,
            prefill_tokens=0,
            decode_row_steps=0,
            live_row_steps=0,  # decode row-steps of rows still live: the rest is padding
            sampled_tokens=0,
            preemptions=0,
            chunks=0,
            resumed_chunks=0,  # chunks that resumed from the last one's copy: no page gather
            compacted_chunks=0,  # of those, chunks of fewer rows than the last one
            peak_pages=0,
            prefill_s=0.0,
            admit_s=0.0,
            decode_s=0.0,
            host_s=0.0,
        )
        self.chunk_shapes = Counter()
        self.pool.peak_in_use = self.pool.in_use
        queue: deque = deque()
        self._enqueue(seqs, queue)
        served = len(first)
        slots: list[_Seq | None] = [None] * self.max_slots
        admitted: list[_Seq] = []  # live rows in admission order (preemption: newest first)
        try:
            while True:
                if not queue and None in slots:
                    given = feed()
                    if given:
                        self._enqueue(self._seqs(given, params, served), queue)
                        served += len(given)
                    elif not admitted:
                        break  # nothing live and nothing more: done
                self._refill(queue, slots, admitted)
                if not admitted:
                    raise AssertionError("no row could be admitted although every request fits")
                self._grow(queue, slots, admitted)
                self._decode_chunk(slots, admitted, on_done)
                if self.check:
                    self._check_pool(queue, admitted)
        except BaseException:
            self._abandon(queue, admitted)
            raise
        finally:
            self._last = None  # the rows' copy: as large as their cache
        self.stats["peak_pages"] = self.pool.peak_in_use
        programs = self.stats["prefill_s"] + self.stats["admit_s"] + self.stats["decode_s"]
        self.stats["host_s"] = time.perf_counter() - began - programs
        return served

    def _enqueue(self, seqs: list[_Seq], queue: deque) -> None:
        """Queue one feed's rows: fresh requests with the same prompt as one group,
        prefilled once (groups never span feeds: an earlier feed's group may be gone)."""
        groups: dict[tuple[int, ...], _Group] = {}
        for seq in seqs:
            if seq.cached == 0 and not seq.pages:
                key = tuple(seq.history)
                if key not in groups:
                    groups[key] = _Group(prompt=list(seq.history), members=deque())
                    queue.append(groups[key])
                groups[key].members.append(seq)
                seq.group = groups[key]
            else:
                queue.append(seq)

    def _completion(self, seq: _Seq) -> Completion:
        routing = None
        if self.cfg.moe:
            shape = (self.cfg.num_layers, self.cfg.num_experts_per_tok)
            routing = np.asarray(seq.routing, np.int32).reshape(-1, *shape)
        return Completion(seq.out, seq.logps, seq.reason, seq.handle, routing)

    def _abandon(self, queue, admitted) -> None:
        """After an error: free every page this call holds (parked requests keep theirs)."""
        for seq in admitted:
            self.pool.release(seq.pages)
            seq.pages = []
        for unit in queue:
            if isinstance(unit, _Group) and unit.pages:
                self.pool.release(unit.pages)
                unit.pages = []

    def _check_pool(self, queue, admitted) -> None:
        holders = [s.pages for s in admitted] + [s.pages for s in self._parked.values()]
        holders += [u.pages for u in queue if isinstance(u, _Group)]
        self.pool.check(holders)

    def _live_need(self, admitted: list[_Seq]) -> int:
        """Pages the live rows still need for their next chunk."""
        return sum(self._growth(s) for s in admitted)

    def _growth(self, seq: _Seq) -> int:
        fed = len(seq.history) - 1 + min(self.chunk, seq.left)  # positions written by then
        return max(0, self._pages_for(fed) - len(seq.pages))

    def _refill(self, queue: deque, slots: list, admitted: list[_Seq]) -> None:
        """Admit queued rows into free slots (FIFO, while pages last): one prefill of the
        new prompts and requests, then one program that copies partial pages and samples
        the admitted rows' first tokens."""
        free_slots = [i for i, s in enumerate(slots) if s is None]
        reserve = self._live_need(admitted)
        prefill: list[tuple[object, list[int], int, list[int]]] = []  # (unit, tokens, start, pages)
        entering: list[tuple[_Seq, object]] = []  # (row, its logits source)
        copies: list[tuple[int, int]] = []
        size = self.page_size
        for unit in queue:
            if not free_slots:
                break
            if isinstance(unit, _Group):
                p = len(unit.prompt)
                partial = p % size != 0
                if not unit.pages:
                    cost = self._pages_for(p)
                    if self.pool.num_free - reserve < cost:
                        break
                    unit.pages = self.pool.alloc(cost)
                    prefill.append((unit, unit.prompt, 0, unit.pages))
                n_full = p // size
                blocked = False
                while unit.members and free_slots:
                    seq = unit.members[0]
                    grow = self._pages_for(p + min(self.chunk, seq.left)) - n_full
                    if self.pool.num_free - reserve < grow:
                        blocked = True
                        break
                    unit.members.popleft()
                    self.pool.share(unit.pages[:n_full])
                    seq.pages = unit.pages[:n_full]
                    if partial:
                        own = self.pool.alloc(1)[0]
                        copies.append((unit.pages[-1], own))
                        seq.pages = seq.pages + [own]
                        grow -= 1
                    reserve += grow
                    seq.cached = p
                    entering.append((seq, unit))
                    slots[free_slots.pop(0)] = seq
                if blocked:
                    break
            else:
                seq = unit
                fed = len(seq.history)
                cost = self._pages_for(fed) - len(seq.pages)
                grow = self._pages_for(fed - 1 + min(self.chunk, seq.left)) - self._pages_for(fed)
                if self.pool.num_free - reserve < cost + max(grow, 0):
                    break
                seq.pages = seq.pages + self.pool.alloc(cost)
                reserve += max(grow, 0)
                prefill.append((seq, seq.history[seq.cached :], seq.cached, seq.pages))
                entering.append((seq, seq))
                slots[free_slots.pop(0)] = seq
        while queue and (
            (isinstance(queue[0], _Group) and not queue[0].members)
            or (isinstance(queue[0], _Seq) and any(seq is queue[0] for seq, _ in entering))
        ):
            unit = queue.popleft()
            if isinstance(unit, _Group):
                self.pool.release(unit.pages)  # its members hold their own references
                unit.pages = []
        if prefill:
            self._prefill(prefill)
        if entering:
            self._enter(entering, copies)
            admitted.extend(seq for seq, _ in entering)

    def _prefill(self, rows: list[tuple[object, list[int], int, list[int]]]) -> None:
        """One `_extend` call over the rows; each unit's logits are kept for `_enter`."""
        run = self._run
        b = bucket(len(rows), self.slot_buckets)
        t = bucket(max(len(tok) for _, tok, _, _ in rows), self.prompt_buckets)
        # The table's width follows the token bucket (fresh prompts: one width per bucket).
        width = max(max(len(pg), self._pages_for(s + t)) for _, _, s, pg in rows)
        width = bucket(width, PAGE_BUCKETS)
        trash = self.pages.trash
        tokens = np.full((b, t), self.pad_id, np.int32)
        start = np.zeros(b, np.int32)
        count = np.zeros(b, np.int32)
        table = np.full((b, width), trash, np.int32)
        for r, (_, tok, s, pg) in enumerate(rows):
            tokens[r, : len(tok)] = tok
            start[r], count[r] = s, len(tok)
            table[r, : len(pg)] = pg
        fn = self._program(
            _extend, 1, run["graphdef"], dtype=run["dtype"], attention=self.attention
        )
        began = time.perf_counter()
        logits, self.pages, routing = fn(
            run["state"], self.pages, *map(self._put, (tokens, start, count, table))
        )
        if self.profile:
            jax.block_until_ready(logits)
        if routing is not None:  # [B, T, layers, k] on the host
            routing = np.moveaxis(jax.device_get(routing), 0, 2)
        self.stats["prefill_s"] += time.perf_counter() - began
        for r, (unit, tok, s, _) in enumerate(rows):
            unit.logits = logits[r]
            if routing is not None:  # the fed tokens' experts replace any from before
                unit.routing = unit.routing[:s] + list(routing[r, : len(tok)])
            self.stats["prefill_rows"] += 1
            self.stats["prefill_tokens"] += len(tok)

    def _keys(self, seqs: Sequence[_Seq], n: int) -> jax.Array:
        data = np.zeros((n, *seqs[0].key.shape), np.uint32)
        for r, s in enumerate(seqs):
            data[r] = s.key
        data[len(seqs) :] = data[0]
        return jax.random.wrap_key_data(self._put(data))

    def _enter(self, entering: list[tuple[_Seq, object]], copies: list[tuple[int, int]]) -> None:
        """Copy the members' partial pages and sample every entering row's first token."""
        self._last = None  # a resumed row comes back with tokens its copy lacks
        run = self._run
        a = bucket(len(entering), self.slot_buckets)
        trash = self.pages.trash
        src = np.full(a, trash, np.int32)
        dst = np.full(a, trash, np.int32)
        for i, (s, d) in enumerate(copies):
            src[i], dst[i] = s, d
        seqs = [seq for seq, _ in entering]
        logits = [source.logits for _, source in entering]
        logits = jnp.stack(logits + [logits[0]] * (a - len(logits)))
        steps = np.zeros(a, np.int32)
        steps[: len(seqs)] = [s.step for s in seqs]
        fn = self._program(_admit, 0, **run["flags"])
        began = time.perf_counter()
        token, logp, self.pages = fn(
            self.pages,
            self._put(src),
            self._put(dst),
            logits,
            self._keys(seqs, a),
            self._put(steps),
            *run["sampling"],
        )
        token, logp = jax.device_get((token, logp))
        self.stats["admit_s"] += time.perf_counter() - began
        for r, seq in enumerate(seqs):
            seq.cached = len(seq.history)
            if seq.group is not None:  # a group's member: its prompt's routing
                seq.routing = list(seq.group.routing)
            seq.group = None
            self._emit(seq, [int(token[r])], [float(logp[r])])
        for seq, _ in entering:  # a prefilled request no longer needs its logits
            seq.logits = None

    def _emit(self, seq: _Seq, tokens: list[int], logps: list[float]) -> None:
        """Append sampled tokens to a row, stopping at EOS, a stop sequence or the limit."""
        for tok, lp in zip(tokens, logps, strict=True):
            seq.history.append(tok)
            seq.out.append(tok)
            seq.logps.append(lp)
            seq.step += 1
            seq.left -= 1
            self.stats["sampled_tokens"] += 1
            if tok == self.eos_id:
                seq.reason = "eos"
            elif self._stopped(seq):
                seq.reason = "stop"
            elif seq.left == 0:
                seq.reason = "length"
            if seq.reason is not None:
                return

    def _stopped(self, seq: _Seq) -> bool:
        out = seq.out
        if any(len(out) >= len(s) and tuple(out[-len(s) :]) == s for s in seq.stop):
            return True
        if seq.stop_strings:
            text = self.detokenize(out)
            return any(s in text for s in seq.stop_strings)
        return False

    def _grow(self, queue: deque, slots: list, admitted: list[_Seq]) -> None:
        """Give every live row the pages its next chunk writes; when the pool is out,
        preempt the newest row (its pages freed, queued first again with its history)."""
        for seq in list(admitted):
            if seq.reason is not None or seq not in admitted:
                continue
            while True:
                need = self._growth(seq)
                try:
                    seq.pages = seq.pages + self.pool.alloc(need)
                    break
                except PoolExhausted:
                    victim = admitted[-1]
                    self._preempt(victim, queue, slots, admitted)
                    if victim is seq:
                        break

    def _preempt(self, seq: _Seq, queue: deque, slots: list, admitted: list[_Seq]) -> None:
        self._last = None  # its cache is recomputed when it comes back: gather that
        admitted.remove(seq)
        slots[slots.index(seq)] = None
        self.pool.release(seq.pages)
        seq.pages, seq.cached = [], 0
        queue.appendleft(seq)
        self.stats["preemptions"] += 1

    def decode_program(self) -> Callable:
        """The current (or last) run's jitted decode chunk, its weights bound: (pages,
        resident, token, pos, step, keys, left, table, temperature, top_k, top_p) ->
        `_decode`'s outputs; it donates the pages and `resident`. Each (rows, table
        width) shape compiles twice: gathering the rows' pages, and resuming."""
        run = self._run
        fn = self._program(
            _decode,
            (2, 3),  # (state, weights, pages, resident, ...)
            run["graphdef"],
            n_steps=self.chunk,
            dtype=run["dtype"],
            layout=self.decode_layout,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            **run["flags"],
        )
        return functools.partial(fn, run["state"], run["weights"])

    def _floor(self, r: int) -> jax.Array:
        """The live rows at or below which a chunk of `r` rows ends early: the next smaller
        row bucket's size (the next chunk runs that bucket's cheaper program), or 0 (it
        ends when every row has stopped). Traced, so no bucket compiles twice for it."""
        below = [b for b in self.slot_buckets if b < r]
        return self._put(np.int32(below[-1] if below else 0))

    def _arrange(self, live: list[_Seq], r: int, width: int) -> tuple[list, tuple | None]:
        """The chunk's rows in program order (None: a padding row) and the copy of their
        cache to resume from (None: gather it from the pages).

        When no row is new to the last chunk and the table is as wide: with as many rows,
        each row keeps its place and a row that stopped leaves a padding row behind, so
        that the last chunk's copy of the rows' cache (`_decode`'s `resident`) still lines
        up; with fewer (the last chunk ended early, `_floor`), the rows keep their order
        and the chunk copies theirs out of the last one's copy. Either skips the chunk's
        page gather (module docstring). Otherwise the live rows in slot order. The order
        depends on the schedule alone, whether the copy is kept or not (`resident_rows`),
        so a batch's bytes do not depend on that setting."""
        last, self._last = self._last, None  # a gathering chunk frees the old copy first
        here = set(live)
        if last is None or last.shape[1] != width or not here.issubset(last.rows):
            return live + [None] * (r - len(live)), None
        if last.shape[0] == r:
            return [s if s in here else None for s in last.rows], last.copy
        kept = [i for i, s in enumerate(last.rows) if s in here]
        rows = [last.rows[i] for i in kept] + [None] * (r - len(kept))
        if last.copy is None:
            return rows, None
        picks = np.array(kept + [kept[0]] * (r - len(kept)), np.int32)  # padding: any row
        self.stats["compacted_chunks"] += 1
        return rows, self._program(_pick_rows, ())(last.copy, self._put(picks))

    def _decode_chunk(
        self, slots: list, admitted: list[_Seq], on_done: Callable[[int, Completion], None]
    ) -> None:
        """One jitted chunk over the live rows, then retire the rows that stopped."""
        live = [s for s in slots if s is not None and s.reason is None]
        if live:
            run = self._run
            r = bucket(len(live), self.slot_buckets)
            # At least MIN_WIDTH tokens (and the smallest prompt bucket): short rows share
            # one program (attention over a few dozen extra keys costs next to nothing).
            floor = max(MIN_WIDTH, self.prompt_buckets[0])
            width = max(max(len(s.pages) for s in live), self._pages_for(floor))
            width = bucket(width, PAGE_BUCKETS)
            rows, resident = self._arrange(live, r, width)
            trash = self.pages.trash
            token = np.full(r, self.pad_id, np.int32)
            pos = np.zeros(r, np.int32)
            step = np.zeros(r, np.int32)
            left = np.zeros(r, np.int32)  # 0: a padding row, which samples nothing
            table = np.full((r, width), trash, np.int32)
            for i, s in enumerate(rows):
                if s is not None:
                    token[i], pos[i], step[i] = s.history[-1], len(s.history) - 1, s.step
                    left[i] = s.left
                    table[i, : len(s.pages)] = s.pages
            fn = self.decode_program()
            began = time.perf_counter()
            tokens, logps, emitted, self.pages, routing, copy = fn(
                self.pages,
                resident,
                *map(self._put, (token, pos, step)),
                self._keys([s or live[0] for s in rows], r),
                self._put(left),
                self._floor(r),
                self._put(table),
                *run["sampling"],
            )
            self._last = _LastChunk(rows, (r, width), copy if self.resident_rows else None)
            self.stats["resumed_chunks"] += resident is not None
            tokens, logps, emitted, routing = jax.device_get((tokens, logps, emitted, routing))
            self.stats["decode_s"] += time.perf_counter() - began
            self.stats["chunks"] += 1
            self.stats["decode_row_steps"] += r * steps_run(emitted)
            self.stats["live_row_steps"] += int(emitted.sum())
            self.chunk_shapes[(r, width)] += 1
            for i, s in enumerate(rows):
                if s is None:
                    continue
                n = int(emitted[i].sum())
                if routing is not None:  # the n tokens it fed: history[-1], then all but one
                    s.routing += list(routing[:n, :, i])
                self._emit(s, tokens[i, :n].tolist(), logps[i, :n].tolist())
                s.cached = len(s.history) - 1
        for i, s in enumerate(slots):
            if s is not None and s.reason is not None:
                slots[i] = None
                admitted.remove(s)
                if s.keep:  # parked with its pages until resumed or released
                    s.handle = self._next_handle
                    self._next_handle += 1
                    self._parked[s.handle] = s
                else:
                    self.pool.release(s.pages)
                    s.pages = []
                on_done(s.index, self._completion(s))
