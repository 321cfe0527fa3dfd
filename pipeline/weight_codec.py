"""Pure functions on weight tensors for the parameter server: tensor-parallel pieces, casts
to the published dtype, and XOR deltas between two versions.

Pieces. A tensor the sampler's mesh splits over its ``tensor`` axis (``axis`` not None) is
stored as ``parts`` C-contiguous pieces, piece ``r`` being what tensor rank ``r`` holds
(``np.split`` along ``axis``: the same blocks ``jax.sharding.NamedSharding`` gives devices).
Replicated tensors are one piece.

Deltas. A piece of version ``v`` is stored against the same piece of its base version as
the XOR of their bit patterns (exact and its own inverse: ``old ^ (old ^ new) == new`` for
every value, NaN payloads and -0.0 included). Unchanged elements give zero words. The XOR
words are split into byte planes (all first bytes, then all second bytes, ...) before
zstd: a small change of a float flips low mantissa bits only, so the planes of the sign and
exponent bytes are nearly all zero and compress to almost nothing, where the interleaved
words would not (benchmarks/results/paramserver_deltas.md compares it with a sparse
index + value encoding). The planes are cut in blocks of ``BLOCK_ELEMS`` elements (the
planes of block 0, then of block 1, ...; one zstd frame per piece), so that a reader
rebuilds a piece block by block in its CPU cache (``apply_delta``). A piece that did not
change at all has an empty delta.
"""

from __future__ import annotations

from typing import Any

import google_crc32c
import numpy as np
import zstandard

__all__ = [
    "BLOCK_ELEMS",
    "CODEC",
    "CODECS",
    "DeltaError",
    "apply_delta",
    "cast_for_publish",
    "encode_delta",
    "join_pieces",
    "split_pieces",
]

CODEC = "xor-byteplane-blocks-zstd"
# Elements per block of byte planes: a block's planes, its words and the output and base
# slices it touches (4 x 256 KiB for bfloat16) stay within a core's 2 MiB L2 cache.
BLOCK_ELEMS = 1 << 17
# Codecs a reader decodes: {name: elements per block (None: the whole piece is one block)}.
# "xor-byteplanes-zstd" is the unblocked layout of the first delta versions.
CODECS: dict[str, int | None] = {CODEC: BLOCK_ELEMS, "xor-byteplanes-zstd": None}
# zstd level 1: on bfloat16 deltas of an RL run it compresses as well as the default (3)
# (benchmarks/results/paramserver_deltas.md) in about half the trainer's time; decoding
# costs the same at every level.
ZSTD_LEVEL = 1
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Published dtypes by config name (pipeline.paramserver.config.ParamServerConfig.dtype).
PUBLISH_DTYPES = ("float32", "bfloat16")


class DeltaError(ValueError):
    """A delta does not fit the piece it is applied to (sizes, codec)."""


def cast_for_publish(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Floating tensors cast to ``dtype`` ("float32" or "bfloat16", round to nearest even
    as XLA's convert does); other dtypes (ints, bools) unchanged."""
    if dtype not in PUBLISH_DTYPES:
        raise ValueError(
            f"publish dtype {dtype!r} is invalid; allowed: {', '.join(PUBLISH_DTYPES)}"
        )
    if dtype == "bfloat16":
        import ml_dtypes

        target = np.dtype(ml_dtypes.bfloat16)
    else:
        target = np.dtype(np.float32)
    out = {}
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        floating = np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16"
        out[name] = arr.astype(target) if floating and arr.dtype != target else arr
    return out


def split_pieces(arr: np.ndarray, axis: int | None, parts: int) -> list[np.ndarray]:
    """The ``parts`` pieces of ``arr`` along ``axis`` (each C-contiguous); ``[arr]`` when
    ``axis`` is None. The axis must divide evenly (``tpu_jobs.model.mesh.split_axes`` only names
    such axes)."""
    if axis is None or parts == 1:
        return [arr]
    if not 0 <= axis < arr.ndim or arr.shape[axis] % parts:
        raise ValueError(
            f"cannot split shape {arr.shape} into {parts} pieces along axis {axis}; "
            f"allowed: an axis whose size is a multiple of {parts}"
        )
    if axis == 0:  # row blocks of a C array are contiguous already: views, no copy
        return list(np.split(arr, parts, axis=0))
    return [np.ascontiguousarray(p) for p in np.split(arr, parts, axis=axis)]


def join_pieces(pieces: list[np.ndarray], axis: int | None) -> np.ndarray:
    if axis is None or len(pieces) == 1:
        return pieces[0]
    return np.concatenate(pieces, axis=axis)


def _words(arr: np.ndarray) -> np.ndarray:
    """``arr``'s elements as unsigned words of its item size (bytes for odd sizes)."""
    flat = arr.reshape(-1)
    return (
        flat.view(_UINT[arr.dtype.itemsize]) if arr.dtype.itemsize in _UINT else flat.view(np.uint8)
    )


def encode_delta(new: np.ndarray, old: np.ndarray) -> bytes:
    """The delta taking piece ``old`` to ``new`` (same shape and dtype), in ``CODEC``; empty
    when nothing changed (the reader then keeps ``old`` without decoding anything)."""
    if new.shape != old.shape or new.dtype != old.dtype:
        raise DeltaError(
            f"delta between {new.shape} {new.dtype} and {old.shape} {old.dtype}: "
            "allowed only between pieces of one shape and dtype"
        )
    nw, ow = _words(new), _words(old)
    size, n = nw.dtype.itemsize, nw.size
    if n == 0 or np.array_equal(nw, ow):
        return b""
    xor = np.empty(min(n, BLOCK_ELEMS), nw.dtype)
    planes = np.empty(size * xor.size, np.uint8)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj(size=n * size)
    chunks = []
    for start in range(0, n, BLOCK_ELEMS):
        m = min(BLOCK_ELEMS, n - start)
        x = np.bitwise_xor(nw[start : start + m], ow[start : start + m], out=xor[:m])
        block = planes[: size * m].reshape(size, m)  # contiguous, for zstd
        np.copyto(block, x.view(np.uint8).reshape(m, size).T)
        chunks.append(compressor.compress(block))
    chunks.append(compressor.flush())
    return b"".join(chunks)


def apply_delta(
    blob: bytes | memoryview, old: np.ndarray, codec: str = CODEC, out: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """``old`` with the delta applied, and the crc32c of its bytes: written into ``out`` (an
    array of ``old``'s shape and dtype, which may be ``old`` itself when the caller owns it;
    None: a new array), or ``old`` itself when the delta is empty (nothing changed). ``old``
    is modified only when it is ``out``.

    Block by block (a few hundred KiB, so every step works in the CPU's cache): zstd
    decodes the block's byte planes into a reused buffer, shifts and ORs them back into
    words, XORs those with ``old``'s into the output and extends the crc32c over it, so
    the piece's memory is read and written once; the ``old`` codec's single block is the
    whole piece."""
    if codec not in CODECS:
        raise DeltaError(f"unknown delta codec {codec!r} (allowed: {', '.join(CODECS)})")
    ow = _words(old)
    size, n = ow.dtype.itemsize, ow.size
    if len(blob) == 0:
        return old, int(google_crc32c.value(ow.view(np.uint8)))
    per_block = CODECS[codec] or max(n, 1)
    if out is None:
        out = np.empty_like(ow)
    elif out.shape != old.shape or out.dtype != old.dtype or not out.flags.c_contiguous:
        raise DeltaError(f"out {out.shape} {out.dtype} does not fit {old.shape} {old.dtype}")
    else:
        out = _words(out)
    raw = np.empty(size * min(n, per_block), np.uint8)
    word = np.empty(min(n, per_block), ow.dtype)
    crc = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=False) as reader:
            for start in range(0, n, per_block):
                m = min(per_block, n - start)
                planes = _read_exactly(reader, raw[: size * m]).reshape(size, m)
                w = word[:m]
                np.copyto(w, planes[size - 1])
                for b in range(size - 2, -1, -1):  # little-endian: plane b is byte b
                    np.left_shift(w, 8, out=w)
                    np.bitwise_or(w, planes[b], out=w)
                done = np.bitwise_xor(ow[start : start + m], w, out=out[start : start + m])
                crc = google_crc32c.extend(crc, done.view(np.uint8))
            if reader.read(1):
                raise DeltaError(f"delta holds more than the piece's {n * size} bytes")
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta does not decompress: {exc}") from None
    return out.view(old.dtype).reshape(old.shape), int(crc)


def _read_exactly(reader: Any, buf: np.ndarray) -> np.ndarray:
    view, got = memoryview(buf), 0
    while got < len(view):
        k = reader.readinto(view[got:])
        if not k:
            raise DeltaError(f"delta ends {len(view) - got} bytes short of its piece's block")
        got += k
    return buf
