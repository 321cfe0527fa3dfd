"""A paged KV cache: a pool of fixed-size pages, a block table per sequence, and the one
attention function that reads them (`PAGED_ATTENTION`).

The pool holds the keys and values of every layer in pages of `page_size` token slots:
k[i], v[i]: [num_pages + 1, page_size, kv_heads, head_dim] for layer i. The last page is
the *trash page*: writes that must go nowhere (padding tokens, finished rows of a decode
chunk) go there, so every program has static shapes and no branch. A sequence's cache is
the list of its pages in order, its *block table* row: token position p lives in page
`table[p // page_size]` at offset `p % page_size`. Pages are handed out by `PagePool`, a
host-side allocator with reference counts, so a prompt's full pages can be shared by the
G samples of a group (`tpu_jobs.generate.engine`).

On XLA:CPU a bfloat16 pool is held as uint32 words, each the bit pattern of two adjacent
head-dim elements (`PACKED_PAGES`; `pack` / `unpack`): XLA:CPU runs a bfloat16 scatter
as a copy of the whole operand (the 100m preset's 24 page arrays, 8 rows x 8 tokens
written: 557 ms, against 0.27 ms into the same pages as uint32, measured on a 2-core
Xeon), while a uint32 scatter updates in place. The words are bit-exact: unpacking gives
back the bfloat16 values written. Gathers unpack their (small) copies; float32 pools and
other platforms hold the compute dtype itself.

Memory is the pool, sized by a token budget (`num_pages * page_size` tokens), not batch x
maximum length: what it holds at a time is the tokens actually in flight.

Attention reads a sequence's pages through `PAGED_ATTENTION[name]` (prefill and resumed
tokens); "gather" (the default, any platform) gathers the block table's pages into a
dense [B, pages * page_size] view and runs the model's dense attention over it with the
causal mask of the positions. A decode chunk gathers its rows' pages once
(`gather_rows`), runs its steps on that contiguous copy (`RowsLayer`) and writes the new
keys/values back (`scatter_rows`). Those gathers are where a ragged paged kernel slots in
(Pallas `ragged_paged_attention` on TPU, FlashInfer/FlashAttention-paged on GPU), reading
the pages in place (docs/scaling.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pipeline.config import ModelConfig
from tpu_jobs.model.transformer import ATTENTION, DTYPES


class PoolExhausted(RuntimeError):
    """Fewer free pages than asked for (the engine preempts or waits)."""


class PagePool:
    """Host-side allocator of `num_pages` KV pages with reference counts.

    `alloc(n)` hands out n free pages (lowest ids first, so runs are deterministic) with
    one reference each; `share(pages)` adds a reference (a prompt page read by another
    sample); `release(pages)` drops one, and a page returns to the free list when none is
    left. A page is never handed out while referenced."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages} is invalid; allowed: > 0")
        self.num_pages = int(num_pages)
        self.refs = np.zeros(self.num_pages, np.int64)
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: pop() = lowest id
        self.peak_in_use = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{n} pages asked, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            if self.refs[p] != 0:  # the free list and the counts disagree: a bug
                raise AssertionError(f"page {p} handed out while it has {self.refs[p]} refs")
            self.refs[p] = 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return pages

    def share(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise AssertionError(f"page {p} shared while free")
            self.refs[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise AssertionError(f"page {p} released while free")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)
        # Keep handing out the lowest ids first, whatever the order of releases.
        self._free.sort(reverse=True)

    def check(self, holders: Iterable[Iterable[int]]) -> None:
        """Raise AssertionError unless the reference counts are exactly the number of
        holders of each page (a holder: one sequence's block table, or a group's prompt)
        and the free list is exactly the unreferenced pages."""
        counts = np.zeros(self.num_pages, np.int64)
        for pages in holders:
            for p in pages:
                counts[p] += 1
        if not np.array_equal(counts, self.refs):
            bad = np.flatnonzero(counts != self.refs)[:8].tolist()
            raise AssertionError(f"page refs disagree with holders at pages {bad}")
        free = sorted(self._free)
        if free != np.flatnonzero(self.refs == 0).tolist() or len(set(free)) != len(free):
            raise AssertionError("the free list is not exactly the unreferenced pages")


# (platform, compute dtype) -> the word a page array holds instead of the compute dtype:
# two bfloat16 values per uint32 on XLA:CPU (module docstring).
PACKED_PAGES: dict[tuple[str, str], jnp.dtype] = {("cpu", "bfloat16"): jnp.dtype(jnp.uint32)}


def pack(x: jax.Array, like: jax.Array) -> jax.Array:
    """Keys/values x [..., hd] in the storage of the page array `like`: x's values cast to
    like's dtype, or (a packed array, uint32) bfloat16 pairs bit-cast to words [..., hd/2]."""
    if like.dtype != jnp.uint32:
        return x.astype(like.dtype)
    pairs = x.astype(jnp.bfloat16).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return jax.lax.bitcast_convert_type(pairs, jnp.uint32)


def unpack(a: jax.Array) -> jax.Array:
    """The keys/values [..., hd] that a page array (or a gathered copy of one) holds."""
    if a.dtype != jnp.uint32:
        return a
    pairs = jax.lax.bitcast_convert_type(a, jnp.bfloat16)  # [..., hd/2, 2]
    return pairs.reshape(*a.shape[:-1], 2 * a.shape[-1])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedKV:
    """The device side of the pool: per-layer key and value pages (module docstring)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def trash(self) -> int:
        """Index of the trash page (the last one)."""
        return self.k[0].shape[0] - 1

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (*self.k, *self.v))


def init_pages(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype: str, platform: str = "cpu"
) -> PagedKV:
    """An empty pool of `num_pages` pages plus the trash page, holding keys/values of
    compute dtype `dtype` for `platform` (packed words where `PACKED_PAGES` says so)."""
    shape = (num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
    dt = PACKED_PAGES.get((platform, dtype)) if cfg.head_dim % 2 == 0 else None
    if dt is None:
        dt = DTYPES[dtype]
    else:
        shape = (*shape[:-1], cfg.head_dim // 2)
    return PagedKV(
        k=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
        v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
    )


def page_bytes(cfg: ModelConfig, page_size: int, dtype: str) -> int:
    """Bytes of one page over all layers (keys and values)."""
    itemsize = jnp.dtype(DTYPES[dtype]).itemsize
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def copy_pages(pages: PagedKV, src: jax.Array, dst: jax.Array) -> PagedKV:
    """Copy page src[i] to dst[i] in every layer (pairs trash -> trash are no-ops)."""
    return PagedKV(
        k=tuple(a.at[dst].set(a[src]) for a in pages.k),
        v=tuple(a.at[dst].set(a[src]) for a in pages.v),
    )


def _gather_attention(q, k_pages, v_pages, table, positions):
    """q [B, T, kv, g, hd] at `positions` [B, T] over the pages of `table` [B, P]: each
    query sees the keys of positions <= its own. Returns [B, T, kv, g, hd]."""
    b, n_pages = table.shape
    size = k_pages.shape[1]
    k = unpack(k_pages[table].reshape(b, n_pages * size, *k_pages.shape[2:]))  # [B, L, kv, hd]
    v = unpack(v_pages[table].reshape(b, n_pages * size, *v_pages.shape[2:]))
    key_pos = jnp.arange(n_pages * size, dtype=jnp.int32)
    visible = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, L]
    return ATTENTION["dense"](q, k.astype(q.dtype), v.astype(q.dtype), visible, 0)


# Attention over paged keys/values: (q [B, T, kv, g, hd], k pages, v pages [N + 1, page,
# kv, hd], block table [B, P], query positions [B, T]) -> [B, T, kv, g, hd]. The one
# place a platform's ragged paged-attention kernel slots in (module docstring).
PAGED_ATTENTION: dict[str, Callable[..., jax.Array]] = {"gather": _gather_attention}


@dataclass(frozen=True)
class PagedLayer:
    """One layer's view of the pool for `Attention.attend` (tpu_jobs.model.transformer): writes the
    new keys/values at (write_page, write_offset) [B, T] and attends over `table`."""

    k: jax.Array
    v: jax.Array
    table: jax.Array
    positions: jax.Array
    write_page: jax.Array
    write_offset: jax.Array
    attention: str = "gather"

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array):
        """q [B, T, heads, hd], k, v [B, T, kv, hd] (post-RoPE) -> (output [B, T,
        heads * hd], (k pages, v pages) with the new tokens written)."""
        b, t, heads, hd = q.shape
        nkv = k.shape[2]
        k_pages = self.k.at[self.write_page, self.write_offset].set(pack(k, self.k))
        v_pages = self.v.at[self.write_page, self.write_offset].set(pack(v, self.v))
        out = PAGED_ATTENTION[self.attention](
            q.reshape(b, t, nkv, heads // nkv, hd), k_pages, v_pages, self.table, self.positions
        )
        return out.reshape(b, t, heads * hd), (k_pages, v_pages)


def gather_rows(pages: PagedKV, table: jax.Array) -> PagedKV:
    """Each row's pages (`table` [B, P]) as one contiguous run: per layer [B, P * page,
    kv, hd], unpacked. A decode chunk gathers once and runs its steps on the copy
    (`RowsLayer`)."""
    b, n = table.shape

    def rows(a: jax.Array) -> jax.Array:
        return unpack(a[table].reshape(b, n * a.shape[1], *a.shape[2:]))

    return PagedKV(k=tuple(map(rows, pages.k)), v=tuple(map(rows, pages.v)))


def scatter_tokens(
    pages: PagedKV,
    keys: Iterable[jax.Array],
    values: Iterable[jax.Array],
    table: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
) -> PagedKV:
    """Write each layer's keys and values [B, C, kv, hd] of tokens at `positions` [B, C]
    where `valid`, into the pages of `table` [B, P] (the rest to the trash page)."""
    size, n = pages.page_size, table.shape[1]
    index = jnp.arange(table.shape[0])[:, None]
    write_page = jnp.where(valid, table[index, jnp.minimum(positions // size, n - 1)], pages.trash)
    write_offset = jnp.where(valid, positions % size, 0)

    def put(page: jax.Array, new: jax.Array) -> jax.Array:
        return page.at[write_page, write_offset].set(pack(new, page))

    return PagedKV(k=tuple(map(put, pages.k, keys)), v=tuple(map(put, pages.v, values)))


def scatter_rows(
    pages: PagedKV, rows: PagedKV, table: jax.Array, positions: jax.Array, valid: jax.Array
) -> PagedKV:
    """Write back the keys/values of `rows` (as `gather_rows` makes them) at `positions`
    [B, C] where `valid`, into their pages (the rest to the trash page)."""
    index = jnp.arange(table.shape[0])[:, None]
    at = jnp.minimum(positions, table.shape[1] * pages.page_size - 1)
    return scatter_tokens(
        pages,
        (a[index, at] for a in rows.k),
        (a[index, at] for a in rows.v),
        table,
        positions,
        valid,
    )


def gather_rows_split(pages: PagedKV, table: jax.Array) -> PagedKV:
    """`gather_rows` in the per-layer cache layout of the feature-major decode step
    (`tpu_jobs.model.transformer.decode_attention`): keys [B, kv, hd, L], values [B, kv,
    L, hd]. Transposed once per chunk, so that no step transposes the rows' cache
    (attention over the [B, L, kv, hd] copy transposed it at every step of every layer);
    the chunk only reads it."""
    rows = gather_rows(pages, table)
    return PagedKV(
        k=tuple(a.transpose(0, 2, 3, 1) for a in rows.k),
        v=tuple(a.transpose(0, 2, 1, 3) for a in rows.v),
    )


@dataclass(frozen=True)
class RowsLayer:
    """One layer's contiguous copy of the rows' keys/values (`gather_rows`) for
    `Attention.attend`: writes the new tokens at `positions` [B, T] and attends over the
    copy with the causal mask of the positions, through the model's dense attention."""

    k: jax.Array
    v: jax.Array
    positions: jax.Array

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array):
        b, t, heads, hd = q.shape
        nkv = k.shape[2]
        index = jnp.arange(b)[:, None]
        k_rows = self.k.at[index, self.positions].set(k.astype(self.k.dtype))
        v_rows = self.v.at[index, self.positions].set(v.astype(self.v.dtype))
        key_pos = jnp.arange(k_rows.shape[1], dtype=jnp.int32)
        visible = key_pos[None, None, :] <= self.positions[:, :, None]
        out = ATTENTION["dense"](
            q.reshape(b, t, nkv, heads // nkv, hd),
            k_rows.astype(q.dtype),
            v_rows.astype(q.dtype),
            visible,
            0,
        )
        return out.reshape(b, t, heads * hd), (k_rows, v_rows)
