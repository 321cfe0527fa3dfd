"""Sequence packing for the trainer: several rollouts per row, kept apart by segment ids.

RL batches are ragged: a row is `prompt_len + completion_len` positions, but most
completions end long before the limit (the demo's median is a tenth of it), so most of a
padded batch's forward and backward work is padding. `pack` lays the real tokens of every
row end to end into fewer rows of the same length (first-fit decreasing, deterministic),
with per-token segment ids and positions that restart at 0 in each segment. The model
attends only within a segment (`tpu_jobs.model.transformer.Transformer.hidden(..., segments=)`), so
every token sees exactly the prefix it saw unpacked, at the same position: the numbers
are the unpacked ones up to float rounding.

The trainer's losses keep the unpacked [rows, completion] layout: `Packing.rows` and
`.cols` say where each completion token of each original row landed, and the LM head and
the value head gather the hidden states that predict those tokens. Only the count of
packed rows varies from batch to batch, and it is rounded up to one of a few buckets
(`buckets`), so the step compiles once per bucket, not once per batch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Packing(NamedTuple):
    """A batch [R, T] packed into [Rp, T] rows (Rp <= R), and where its tokens went.

    tokens, segments, positions: [Rp, T] int32; segments are 1, 2, ... per sequence in a
    packed row, 0 on padding. rows, cols: [R, C] int32, the packed row and column of the
    token at position `T - C + c` of original row r (a padding token points at (0, 1),
    whatever is there: its result is masked by the caller)."""

    tokens: np.ndarray
    segments: np.ndarray
    positions: np.ndarray
    rows: np.ndarray
    cols: np.ndarray


def buckets(rows: int, multiple: int = 1) -> tuple[int, ...]:
    """The packed row counts a batch of `rows` rows may compile for: rows/8, /4, /2 and
    all of them, each rounded up to a multiple of `multiple` (the mesh's data x fsdp)."""
    out = {-(-max(1, -(-rows // d)) // multiple) * multiple for d in (8, 4, 2, 1)}
    return tuple(sorted(out))


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of row indices, each bin's lengths summing to at most `capacity`: rows in
    decreasing length (ties by index), each into the first bin it fits. Deterministic."""
    bins: list[list[int]] = []
    free: list[int] = []
    for r in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        n = int(lengths[r])
        if n > capacity:
            raise ValueError(f"row {r} has {n} tokens; a packed row holds {capacity}")
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(r)
                free[b] -= n
                break
        else:
            bins.append([r])
            free.append(capacity - n)
    return bins


def pack(tokens: np.ndarray, mask: np.ndarray, completion_len: int, multiple: int = 1) -> Packing:
    """Pack the real tokens (mask == 1) of `tokens` [R, T] into as few rows of T as the
    buckets allow (`buckets(R, multiple)`), each row's tokens kept in order in one
    segment. `completion_len`: the last C columns of a row are its completion, whose
    tokens' packed places are returned in `rows` / `cols` [R, C]. Rows with no token (a
    dynamic-sampling batch's missing groups) take no room."""
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    r_total, t = tokens.shape
    lengths = mask.sum(axis=1).astype(np.int64)
    bins = first_fit_decreasing(lengths, t)
    n_rows = next(b for b in buckets(r_total, multiple) if b >= len(bins))
    out_tok = np.zeros((n_rows, t), np.int32)
    out_seg = np.zeros((n_rows, t), np.int32)
    out_pos = np.zeros((n_rows, t), np.int32)
    c = completion_len
    rows = np.zeros((r_total, c), np.int32)
    cols = np.ones((r_total, c), np.int32)
    for p, members in enumerate(bins):
        offset = 0
        for seg, r in enumerate(members, start=1):
            real = np.flatnonzero(mask[r])
            n = len(real)
            out_tok[p, offset : offset + n] = tokens[r, real]
            out_seg[p, offset : offset + n] = seg
            out_pos[p, offset : offset + n] = np.arange(n)
            # The k-th real token of the row sits at column offset + k; a completion
            # position's k is the number of real tokens before it.
            k = np.cumsum(mask[r]) - 1
            live = mask[r, t - c :] > 0
            rows[r, live] = p
            cols[r, live] = offset + k[t - c :][live]
            offset += n
    return Packing(out_tok, out_seg, out_pos, rows, cols)
