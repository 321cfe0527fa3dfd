"""The reading side of versions: a chain's shard objects fetched in parallel (ranged reads
of remote objects), and each piece rebuilt from its full snapshot or a held piece and the
deltas after it, verified against the crc32c its manifest records.

Download and rebuild overlap: shards are fetched in the order their pieces are needed, and
a piece is rebuilt (on one of as many threads as there are CPUs: zstd, NumPy and crc32c
release the GIL) as soon as the shards it needs have arrived and passed their crc32c.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pipeline import weight_codec
from pipeline.paramserver.errors import CorruptSnapshotError, SnapshotNotFoundError
from pipeline.paramserver.manifest import crc32c, read_normalized, resolve_dtype
from pipeline.paramserver.publish import cpu_count
from pipeline.paramserver.snapshot import Snapshot
from pipeline.storage import LocalStore, ObjectNotFound, ObjectStore

__all__ = ["BufferPool", "rebuild"]

# The smallest ranged read a pull splits a shard into to keep all its readers busy (see
# ShardReader); ranges are at most the server's ``range_bytes``.
MIN_RANGE_BYTES = 1 << 20

ShardId = tuple[int, str, int]  # (version, "full" | "delta", shard index)
PieceId = tuple[str, int]


class BufferPool:
    """Memory for rebuilt versions, reused once nothing references it any more.

    A worker that keeps up frees one version's memory per pull and asks for as much again.
    Fresh memory costs page faults (about 50 ms per 150 MB in 4 KiB pages), and on a VM that
    hands freed memory back to its host, stalls of about 0.3 s per 150 MB when it is touched
    again (measured here: benchmarks/results/paramserver_deltas.md). So a buffer's memory
    is handed out through a ctypes array over it, the one object every array NumPy makes
    from it keeps alive; when that object dies (no array of the version is left, views
    included) the memory goes back to the pool, which keeps the ``keep`` newest."""

    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes (uint8) of memory nothing else uses: a free buffer of the pool of
        at most 5/4 of that size, or a new one."""
        if nbytes == 0:
            return np.empty(0, np.uint8)
        with self._lock:
            fits = [m for m in self._free if nbytes <= m.size <= nbytes + nbytes // 4]
            if fits:
                self._free.remove(fits[0])
        mem = fits[0] if fits else np.empty(nbytes, np.uint8)
        owner = (ctypes.c_uint8 * nbytes).from_buffer(mem)
        weakref.finalize(owner, self._put, mem)
        return np.frombuffer(owner, np.uint8)

    def _put(self, mem: np.ndarray) -> None:
        with self._lock:
            self._free = [*self._free, mem][-self.keep :] if self.keep else []


def rebuild(
    store: ObjectStore,
    version: int,
    manifest: dict[str, Any],
    have: Snapshot | None,
    want: frozenset[int] | None,
    *,
    max_workers: int,
    range_bytes: int,
    buffers: BufferPool,
) -> Snapshot:
    """``version`` (its normalized ``manifest`` in hand) from ``have`` (or, None, from the
    anchor's full snapshot) and the deltas in between, every piece of the tensor ranks
    ``want`` (None: all) verified against its manifest's crc32c.

    Raises SnapshotNotFoundError for a hole in the chain and CorruptSnapshotError for a
    shard or piece that fails; ``have`` is never modified."""
    start = int(manifest["anchor"]) if have is None else have.version + 1
    chain = list(range(start, version + 1))
    applied = chain if have is not None else chain[1:]
    with ThreadPoolExecutor(max_workers=max_workers) as reads:
        earlier = chain[:-1]  # the target's manifest is in hand
        manifests = dict(
            zip(earlier, reads.map(lambda v: read_normalized(store, v), earlier), strict=True)
        )
        manifests[version] = manifest
        _check_chain(version, manifests, applied, start if have is None else None)
        jobs = [
            (v, kind, i, shard)
            for v in chain
            for kind in (("full",) if (have is None and v == start) else ("delta",))
            for i, shard in enumerate(manifests[v][kind]["shards"])
            if want is None or shard.get("part") is None or shard["part"] in want
        ]
        shards = ShardReader(store, jobs, reads, max_workers=max_workers, range_bytes=range_bytes)
        # Pieces in the order of the shards they first wait for, which is the download's.
        first = manifests[start]["full" if have is None else "delta"]["pieces"]
        order = {(p["name"], p["part"]): int(p["shard"]) for p in first}
        items = sorted(_wanted(manifest, want), key=lambda pid: order.get(pid, 0))
        pieces = _Pieces(
            manifests, shards, start if have is None else None, applied, items, buffers
        )
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, cpu_count()))) as work:
            futures = [work.submit(pieces.build, item, have) for item in items]
            try:
                built = dict(f.result() for f in futures)
            except BaseException:
                for f in futures:
                    f.cancel()
                reads.shutdown(wait=False, cancel_futures=True)
                raise
    return _snapshot(
        manifest, built, want, full_from=None if have is not None else start, deltas=applied
    )


def _check_chain(
    version: int, manifests: dict[int, dict[str, Any]], applied: list[int], full: int | None
) -> None:
    for v in applied:
        delta = manifests[v].get("delta")
        if delta is None or manifests[v].get("base") != v - 1:
            raise SnapshotNotFoundError(
                f"v{v} has no delta against v{v - 1}: the chain to v{version} has a hole"
            )
        if delta.get("codec") not in weight_codec.CODECS:
            raise CorruptSnapshotError(
                f"v{v}: unknown delta codec {delta.get('codec')!r} "
                f"(allowed: {', '.join(weight_codec.CODECS)})"
            )
    if full is not None and "full" not in manifests[full]:
        raise CorruptSnapshotError(f"v{version}'s anchor v{full} holds no full snapshot")


def _wanted(manifest: dict[str, Any], want: frozenset[int] | None) -> list[PieceId]:
    """The pieces a reader of tensor ranks ``want`` needs: every piece of an unsplit tensor
    (part 0) and the wanted ranks' pieces of split ones."""
    parts = int(manifest["parts"])
    out = []
    for t in manifest["tensors"]:
        if t.get("axis") is None:
            out.append((t["name"], 0))
        else:
            out += [(t["name"], r) for r in range(parts) if want is None or r in want]
    return out


class _Pieces:
    """Rebuilds one piece at a time: its full snapshot's bytes (or the held piece), then
    each delta of the chain applied and verified.

    The pieces that deltas change are written into one buffer of the version's size (see
    ``_out``) from a ``BufferPool``, not one allocation each: fresh memory's page faults
    cost a third of a rebuild's CPU time (benchmarks/results/paramserver_deltas.md)."""

    _ALIGN = 64  # a cache line: every dtype's alignment

    def __init__(
        self,
        manifests: dict[int, dict[str, Any]],
        shards: ShardReader,
        full: int | None,
        applied: list[int],
        items: list[PieceId],
        buffers: BufferPool,
    ) -> None:
        self.manifests, self.shards, self.full, self.applied = manifests, shards, full, applied
        self.tensors = {v: {t["name"]: t for t in m["tensors"]} for v, m in manifests.items()}
        self.where = {
            (v, kind): {(p["name"], p["part"]): p for p in m[kind]["pieces"]}
            for v, m in manifests.items()
            for kind in ("full", "delta")
            if kind in m
        }
        self._slots: dict[PieceId, tuple[int, int]] = {}  # (offset, nbytes) in the buffer
        size = 0
        if applied:
            target = self.tensors[applied[-1]]
            for pid in items:
                t = target.get(pid[0])
                if t is None:
                    continue  # refused when its delta is applied
                try:
                    nbytes = math.prod(self._shape(applied[-1], t, pid[1]))
                    nbytes *= resolve_dtype(t["dtype"]).itemsize
                except (KeyError, TypeError, ValueError):
                    continue  # a bad entry: refused when its delta is applied
                self._slots[pid] = (size, nbytes)
                size += -(-nbytes // self._ALIGN) * self._ALIGN
        self._buffer = buffers.take(size)

    def _out(self, pid: PieceId, like: np.ndarray) -> np.ndarray | None:
        """The piece's place in the version's buffer (None if it has none or ``like`` does
        not fit it)."""
        offset, nbytes = self._slots.get(pid, (0, -1))
        if nbytes != like.nbytes:
            return None
        return self._buffer[offset : offset + nbytes].view(like.dtype).reshape(like.shape)

    def build(self, pid: PieceId, have: Snapshot | None) -> tuple[PieceId, np.ndarray]:
        name, r = pid
        if self.full is None:
            piece = None if have is None else have.pieces.get(pid)
        else:
            v = self.full
            t, spec = self.tensors[v].get(name), self.where[(v, "full")].get(pid)
            if t is None or spec is None:
                raise CorruptSnapshotError(f"v{v}: no full piece {r} of {name!r}")
            piece = _view(v, t, self._shape(v, t, r), self._bytes(v, "full", spec))
        ours = False  # whether `piece` is our buffer's: later deltas then apply in place
        for v in self.applied:
            out = piece if ours else (None if piece is None else self._out(pid, piece))
            new = self._apply(v, pid, piece, out)
            ours = ours or new is out
            piece = new
        if ours:
            piece.flags.writeable = False
        return pid, piece

    def _shape(self, version: int, t: dict[str, Any], part: int) -> tuple[int, ...]:
        shape = [int(d) for d in t["shape"]]
        if t.get("axis") is not None:
            shape[int(t["axis"])] //= int(self.manifests[version]["parts"])
        return tuple(shape)

    def _bytes(self, version: int, kind: str, spec: dict[str, Any]) -> Any:
        try:
            buf = self.shards.get((version, kind, int(spec["shard"])))
            offset, nbytes = int(spec["offset"]), int(spec["nbytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptSnapshotError(
                f"snapshot v{version}: bad manifest entry {spec!r}: {exc}"
            ) from None
        if offset < 0 or offset + nbytes > len(buf):
            raise CorruptSnapshotError(
                f"snapshot v{version}: piece {spec!r} does not fit its {len(buf)}-byte shard"
            )
        return memoryview(buf)[offset : offset + nbytes]

    def _apply(
        self, version: int, pid: PieceId, old: np.ndarray | None, out: np.ndarray | None
    ) -> np.ndarray:
        name, r = pid
        t, spec = self.tensors[version].get(name), self.where[(version, "delta")].get(pid)
        shape = None if t is None else self._shape(version, t, r)
        dtype = None if t is None else resolve_dtype(t["dtype"])
        if spec is None or old is None or old.shape != shape or old.dtype != dtype:
            raise CorruptSnapshotError(
                f"v{version}: the delta of {name!r} piece {r} does not fit its base "
                f"({None if old is None else (old.shape, old.dtype)} vs {(shape, dtype)})"
            )
        blob = self._bytes(version, "delta", spec)
        codec = self.manifests[version]["delta"]["codec"]
        try:
            new, actual = weight_codec.apply_delta(blob, old, codec, out)
        except weight_codec.DeltaError as err:
            raise CorruptSnapshotError(f"v{version}: {name!r} piece {r}: {err}") from None
        want_crc = int(t["crc32c"][r if t.get("axis") is not None else 0])
        if actual != want_crc:
            raise CorruptSnapshotError(
                f"v{version}: rebuilt {name!r} piece {r} failed verification: expected "
                f"crc32c {want_crc:08x}, got {actual:08x} (a wrong base or a bad delta)"
            )
        return new


def _view(version: int, t: dict[str, Any], shape: tuple, buf: Any) -> np.ndarray:
    try:
        dtype = resolve_dtype(t["dtype"])
    except (KeyError, TypeError) as exc:
        raise CorruptSnapshotError(f"snapshot v{version}: bad tensor entry {t!r}: {exc}") from None
    count = math.prod(shape)
    if count * dtype.itemsize != len(buf):
        raise CorruptSnapshotError(
            f"snapshot v{version}: tensor {t['name']!r} ({shape}, {dtype}) does not fit "
            f"its {len(buf)} stored bytes"
        )
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


def _snapshot(manifest, pieces, want, *, full_from, deltas) -> Snapshot:
    tensors: dict[str, np.ndarray] = {}
    parts = int(manifest["parts"])
    for t in manifest["tensors"]:
        held = [pieces[(t["name"], r)] for r in range(parts) if (t["name"], r) in pieces]
        tensors[t["name"]] = weight_codec.join_pieces(held, t.get("axis"))
    return Snapshot(
        version=int(manifest["version"]),
        tensors=tensors,
        metadata=manifest.get("metadata", {}),
        epoch=manifest.get("epoch", 0),
        created=manifest.get("created", 0.0),
        ranks=want,
        pieces=pieces,
        full_from=full_from,
        deltas=tuple(deltas),
        parts=parts,
        axes={t["name"]: t.get("axis") for t in manifest["tensors"]},
    )


class ShardReader:
    """The verified bytes of a pull's shard objects. The reads start at construction, in
    ``jobs``' order, on the ``reads`` pool (the pull concurrency): a remote object as ranged
    reads of at most ``range_bytes``, smaller when the pull is small, so that every reader
    has a range (at least ``MIN_RANGE_BYTES``); a local one as a memory map. ``get`` waits
    for one shard, checks its size and crc32c, and keeps it."""

    def __init__(
        self,
        store: ObjectStore,
        jobs: list[tuple[int, str, int, dict[str, Any]]],
        reads: ThreadPoolExecutor,
        *,
        max_workers: int,
        range_bytes: int,
    ) -> None:
        self.store = store
        self._specs = {(v, kind, i): spec for v, kind, i, spec in jobs}
        self._shard_locks = {sid: threading.Lock() for sid in self._specs}
        self._done: dict[ShardId, Any] = {}
        total = sum(int(spec["size"]) for spec in self._specs.values())
        step = min(range_bytes, max(MIN_RANGE_BYTES, -(-total // max_workers)))
        # Whole objects from a store without ranged reads of its own (the default reads the
        # whole object for each range) and from a local one (memory-mapped).
        whole = isinstance(store, LocalStore) or type(store).read_range is ObjectStore.read_range
        self._reads: dict[ShardId, list[Future]] = {}
        for sid, spec in self._specs.items():
            key, size = spec["key"], int(spec["size"])
            if whole or size <= step:
                self._reads[sid] = [reads.submit(self._read, sid, key, 0, -1)]
            else:
                self._reads[sid] = [reads.submit(self._read, sid, key, a, min(step, size - a))
                                    for a in range(0, size, step)]  # fmt: skip

    def _read(self, sid: ShardId, key: str, start: int, length: int) -> Any:
        try:
            if length >= 0:
                return self.store.read_range(key, start, length)
            if isinstance(self.store, LocalStore):
                return _map_file(self.store, key)
            return self.store.read(key)
        except ObjectNotFound:
            raise CorruptSnapshotError(
                f"snapshot v{sid[0]}: shard {self.store.url_of(key)} is missing"
            ) from None

    def get(self, sid: ShardId) -> Any:
        """The shard's bytes, verified; CorruptSnapshotError if missing or failing."""
        with self._shard_locks[sid]:
            if sid in self._done:
                return self._done[sid]
            chunks = [f.result() for f in self._reads[sid]]
            buf = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            spec = self._specs[sid]
            actual = crc32c(buf)
            if len(buf) != spec["size"] or actual != spec["crc32c"]:
                raise CorruptSnapshotError(
                    f"snapshot v{sid[0]}: shard {self.store.url_of(spec['key'])} failed "
                    f"verification: expected crc32c {spec['crc32c']:08x} over {spec['size']} "
                    f"bytes, got crc32c {actual:08x} over {len(buf)} bytes"
                )
            self._done[sid] = buf
            return buf


def _map_file(store: LocalStore, key: str) -> Any:
    """A local object's bytes as a read-only memory map of its file (objects there are
    immutable files, replaced only by linking or renaming new ones, so the map stays valid
    and unchanged, even after the object is deleted), which spares a pull one copy and the
    page faults of fresh memory."""
    try:
        f = open(store.path_of(key), "rb")  # noqa: SIM115 - closed below, the map stays
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise ObjectNotFound(store.url_of(key)) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b""  # an empty file cannot be mapped
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
    return np.frombuffer(mapped, dtype=np.uint8)
