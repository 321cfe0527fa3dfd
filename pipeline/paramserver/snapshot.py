"""A version's tensors in hand, and the pieces the sampler's tensor-parallel mesh cuts them
into (``pipeline.weight_codec.split_pieces``): what ``ParamServer.pull`` returns, and what a
trainer publishes and keeps as the base of its next delta."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline import weight_codec
from pipeline.paramserver.manifest import resolve_dtype

__all__ = ["Snapshot", "check_array", "split_axes_of"]


@dataclass(frozen=True)
class Snapshot:
    """A verified snapshot. Arrays are read-only views over the downloaded shard bytes (for a
    local store, over read-only memory maps of the shard files) or the arrays rebuilt from
    deltas."""

    version: int
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    created: float = 0.0
    # The tensor ranks this snapshot holds (None: all). With some ranks only, a split tensor's
    # entry in ``tensors`` is the concatenation of those ranks' pieces along its split axis.
    ranks: frozenset[int] | None = None
    # The pieces held, by (name, part): what the next delta is applied to.
    pieces: dict[tuple[str, int], np.ndarray] = field(default_factory=dict, repr=False)
    # How it was built: the version whose full snapshot was read (None: from a held version),
    # then the versions whose deltas were applied, in order.
    full_from: int | None = None
    deltas: tuple[int, ...] = ()
    # The cut: tensor ranks of the sampler's mesh, and each tensor's split axis (None: one
    # piece, every rank reads it).
    parts: int = 1
    axes: dict[str, int | None] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        version: int,
        tensors: dict[str, np.ndarray],
        split: dict[str, int | None] | None = None,
        parts: int = 1,
    ) -> Snapshot:
        """A complete snapshot of tensors in hand, checked (``check_array``) and cut into
        ``parts`` pieces along each tensor's ``split`` axis (``tpu_jobs.model.mesh.split_axes``;
        absent or None: replicated): what ``ParamServer.publish_snapshot`` stores, and the
        base of the next version's delta."""
        if not isinstance(tensors, dict) or not tensors:
            raise ValueError("tensors must be a non-empty dict of name -> numpy.ndarray")
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        arrays = {name: check_array(name, arr) for name, arr in tensors.items()}
        axes = split_axes_of(arrays, split, parts)
        pieces = {}
        for name, arr in arrays.items():
            for r, piece in enumerate(weight_codec.split_pieces(arr, axes[name], parts)):
                pieces[(name, r)] = piece
        return cls(version=version, tensors=arrays, pieces=pieces, parts=parts, axes=axes)


def split_axes_of(
    tensors: dict[str, Any], split: dict[str, int | None] | None, parts: int
) -> dict[str, int | None]:
    """{name: the axis a tensor is cut along into ``parts`` pieces, or None (one piece)}:
    ``split``'s entry, or None when there is one part or no entry."""
    return {name: (split or {}).get(name) if parts > 1 else None for name in tensors}


def check_array(name: str, arr: Any) -> np.ndarray:
    """``arr`` as a snapshot stores it (C-contiguous, little-endian), or TypeError/ValueError
    naming what is wrong and what is allowed."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty str, got {name!r}")
    if not isinstance(arr, np.ndarray):
        raise TypeError(
            f"tensor {name!r} must be a numpy.ndarray, got {type(arr).__name__} "
            "(convert device arrays with np.asarray first)"
        )
    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise TypeError(f"tensor {name!r} has unsupported dtype {arr.dtype}: plain numeric only")
    try:
        same = resolve_dtype(arr.dtype.name) == arr.dtype.newbyteorder("=")
    except TypeError:
        same = False
    if not same:
        raise TypeError(
            f"tensor {name!r} has dtype {arr.dtype} that cannot be named in a manifest; "
            "allowed: numpy numeric dtypes and ml_dtypes types such as bfloat16"
        )
    if arr.dtype.byteorder == ">":  # snapshots are little-endian
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return arr if arr.flags.c_contiguous else arr.copy(order="C")
