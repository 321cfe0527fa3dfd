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
index + value encoding).
"""

from __future__ import annotations

import numpy as np
import zstandard

__all__ = [
    "CODEC",
    "DeltaError",
    "apply_delta",
    "cast_for_publish",
    "encode_delta",
    "join_pieces",
    "split_pieces",
]

CODEC = "xor-byteplanes-zstd"
ZSTD_LEVEL = 3  # zstd's default; level 1 was no faster on mostly-zero planes
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Published dtypes by config name (pipeline.config.ParamServerConfig.dtype).
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
    ``axis`` is None. The axis must divide evenly (``tpu_jobs.mesh.split_axes`` only names
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
    flat = arr.reshape(-1)
    return (
        flat.view(_UINT[arr.dtype.itemsize]) if arr.dtype.itemsize in _UINT else flat.view(np.uint8)
    )


def encode_delta(new: np.ndarray, old: np.ndarray) -> bytes:
    """The delta taking piece ``old`` to ``new`` (same shape and dtype)."""
    if new.shape != old.shape or new.dtype != old.dtype:
        raise DeltaError(
            f"delta between {new.shape} {new.dtype} and {old.shape} {old.dtype}: "
            "allowed only between pieces of one shape and dtype"
        )
    x = np.bitwise_xor(_words(new), _words(old))
    size = new.dtype.itemsize if new.dtype.itemsize in _UINT else 1
    planes = x.view(np.uint8).reshape(-1, size).T  # byte planes: [size, n]
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(np.ascontiguousarray(planes))


def apply_delta(blob: bytes | memoryview, old: np.ndarray) -> np.ndarray:
    """``old`` with the delta applied: a new array (``old`` is never modified)."""
    nbytes = old.nbytes
    if nbytes == 0:
        return old.copy()
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(blob), max_output_size=nbytes)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta does not decompress: {exc}") from None
    if len(raw) != nbytes:
        raise DeltaError(f"delta holds {len(raw)} bytes, the piece {nbytes}")
    size = old.dtype.itemsize if old.dtype.itemsize in _UINT else 1
    planes = np.frombuffer(raw, np.uint8).reshape(size, -1)
    # One new buffer, filled plane by plane and XORed in place: fresh memory costs page
    # faults (several seconds per GiB on some VMs), so the rebuild allocates it once.
    words = np.empty((planes.shape[1], size), np.uint8)
    for b in range(size):
        words[:, b] = planes[b]
    out = words.reshape(-1).view(_words(old).dtype)
    np.bitwise_xor(out, _words(old), out=out)
    return out.view(old.dtype).reshape(old.shape)
