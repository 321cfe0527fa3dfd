"""The writing side of a version: its manifest's tensor entries, its pieces (or their
deltas) grouped into shard objects and uploaded in parallel."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline import weight_codec
from pipeline.paramserver.manifest import (
    MANIFEST_FORMAT,
    bytes_of,
    crc32c,
    group_of,
    nbytes_of,
    shard_key,
)
from pipeline.paramserver.snapshot import Snapshot
from pipeline.storage import LocalStore, ObjectStore, StorageError

PieceId = tuple[str, int]


def check_base(snapshot: Snapshot, base: Snapshot) -> None:
    """ValueError unless ``base`` is a complete snapshot of the previous version, cut the
    same way (a delta is taken piece by piece)."""
    version = snapshot.version
    if base.version != version - 1 or base.ranks is not None:
        raise ValueError(
            f"a delta of v{version} needs a complete snapshot of v{version - 1} as its "
            f"base, got v{base.version}" + (" (some ranks only)" if base.ranks else "")
        )
    for pid, piece in snapshot.pieces.items():
        old = base.pieces.get(pid)
        if old is None or old.shape != piece.shape or old.dtype != piece.dtype:
            raise ValueError(
                f"base v{base.version} does not match v{version}'s piece {pid}: "
                f"{None if old is None else (old.shape, old.dtype)} vs "
                f"{(piece.shape, piece.dtype)}; allowed: the same tensors, dtypes and split"
            )


def new_manifest(
    snapshot: Snapshot,
    *,
    epoch: int,
    attempt: str,
    metadata: dict[str, Any],
    anchor: int,
    base: int | None,
    full_every: int,
) -> dict[str, Any]:
    """The manifest of ``snapshot`` before its ``full``/``delta`` sections are written: per
    tensor its shape, dtype, split axis and the crc32c of each piece."""
    parts, axes = snapshot.parts, snapshot.axes
    return {
        "format": MANIFEST_FORMAT,
        "version": snapshot.version,
        "epoch": epoch,
        "attempt": attempt,
        "created": time.time(),
        "metadata": metadata,
        "parts": parts,
        "anchor": anchor,
        "base": base,
        "full_every": full_every,
        "tensors": [
            {
                "name": name,
                "shape": list(arr.shape),
                "dtype": arr.dtype.name,
                "axis": axes[name],
                "crc32c": [
                    crc32c(bytes_of(snapshot.pieces[(name, r)]))
                    for r in range(parts if axes[name] is not None else 1)
                ],
            }
            for name, arr in sorted(snapshot.tensors.items())
        ],
    }


def delta_blobs(snapshot: Snapshot, base: Snapshot, max_workers: int) -> dict[PieceId, bytes]:
    """Each piece's delta against ``base``'s (``weight_codec.encode_delta``), in parallel:
    zstd and NumPy release the GIL."""
    pids = list(snapshot.pieces)
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        blobs = pool.map(
            lambda pid: weight_codec.encode_delta(snapshot.pieces[pid], base.pieces[pid]), pids
        )
        return dict(zip(pids, blobs, strict=True))


def groups_of(snapshot: Snapshot) -> dict[PieceId, str]:
    """The shard group of each piece (``manifest.group_of``)."""
    return {
        pid: group_of(pid[1] if snapshot.axes[pid[0]] is not None else None)
        for pid in snapshot.pieces
    }


def plan_shards(sizes: dict[Any, tuple[str, int]], shard_bytes: int) -> list[tuple[str, list]]:
    """Group pieces into shards: ``sizes`` maps a piece id to (group, nbytes); returns
    ``[(group, [piece ids])]``, each shard within one group (ids sorted, so the layout is
    deterministic).

    A piece is never split. One of at least ``shard_bytes // 16`` (4 MiB by default) gets a
    shard of its own: its bytes are then written straight from the array, never copied into a
    shard buffer, and nearly all of a model's bytes are in such pieces; the small ones (norms,
    biases) share shards.
    """
    solo = max(1, shard_bytes // 16)
    shards: list[tuple[str, list]] = []
    by_group: dict[str, list] = {}
    for pid in sorted(sizes):
        by_group.setdefault(sizes[pid][0], []).append(pid)
    for group in sorted(by_group):
        current: list = []
        size = 0
        for pid in by_group[group]:
            nbytes = sizes[pid][1]
            if nbytes >= solo:
                shards.append((group, [pid]))
                continue
            if current and size + nbytes > shard_bytes:
                shards.append((group, current))
                current, size = [], 0
            current.append(pid)
            size += nbytes
        if current:
            shards.append((group, current))
    return shards


def write_pieces(
    store: ObjectStore,
    version: int,
    kind: str,
    attempt: str,
    payloads: dict[PieceId, Any],
    groups: dict[PieceId, str],
    written: list[str],
    *,
    shard_bytes: int,
    max_workers: int,
) -> dict[str, Any]:
    """Upload ``payloads`` (arrays or bytes, by piece id) as shard objects; the
    manifest's {"shards", "pieces"} for them. Keys written are appended to ``written``."""
    sizes = {pid: (groups[pid], nbytes_of(p)) for pid, p in payloads.items()}
    plan = plan_shards(sizes, shard_bytes)
    keys = [shard_key(version, kind, group, i, attempt) for i, (group, _) in enumerate(plan)]

    def write_shard(i: int) -> dict[str, Any]:
        group, pids = plan[i]
        data = _shard_payload(store, [payloads[pid] for pid in pids])
        if not store.write_new(keys[i], data):
            raise StorageError(f"shard {store.url_of(keys[i])} already exists")
        written.append(keys[i])
        part = None if group == "all" else int(group[1:])
        return {"key": keys[i], "size": nbytes_of(data), "crc32c": crc32c(data), "part": part}

    with ThreadPoolExecutor(max_workers=_writers(store, max_workers, len(plan))) as pool:
        shards = list(pool.map(write_shard, range(len(plan))))
    entries = []
    for shard_index, (_, pids) in enumerate(plan):
        offset = 0
        for name, part in pids:
            nbytes = sizes[(name, part)][1]
            entries.append(
                {
                    "name": name,
                    "part": part,
                    "shard": shard_index,
                    "offset": offset,
                    "nbytes": nbytes,
                }  # fmt: skip
            )
            offset += nbytes
    return {"shards": shards, "pieces": entries}


def _writers(store: ObjectStore, max_workers: int, shards: int) -> int:
    """Upload threads. Local writes are memory copies into the page cache: beyond about
    two per CPU, threads only contend (measured in benchmarks/paramserver.py)."""
    workers = min(max_workers, shards)
    if isinstance(store, LocalStore):
        workers = min(workers, 2 * cpu_count())
    return max(1, workers)


def cpu_count() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _shard_payload(store: ObjectStore, payloads: list[Any]) -> Any:
    """The bytes of one shard. A lone array going to a ``LocalStore`` is passed as a view
    of the array itself (it writes any buffer); other stores get ``bytes``."""
    if len(payloads) == 1:
        if isinstance(payloads[0], (bytes, bytearray)):
            return payloads[0]
        flat = bytes_of(payloads[0])  # a view: the array is C-contiguous
        return flat if isinstance(store, LocalStore) else flat.tobytes()
    return b"".join(bytes_of(p) for p in payloads)


__all__ = [
    "check_base",
    "cpu_count",
    "delta_blobs",
    "groups_of",
    "new_manifest",
    "plan_shards",
    "write_pieces",
]
