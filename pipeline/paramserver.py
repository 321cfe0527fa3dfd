"""Versioned weight snapshots in object storage: the trainer publishes, rollout workers pull.

Layout under the run's store (``weights/``):

* ``v{version:08d}/{full|delta}-{group}-{i:05d}-{attempt}.bin``: shard objects, each the
  concatenated bytes of some tensor *pieces* (``pipeline.weight_codec``). ``group`` is
  ``all`` for pieces every reader needs (unsplit tensors) or ``r{rank:03d}`` for the pieces of
  one rank of the sampler's tensor-parallel mesh, so a host downloads only its ranks' objects.
  The attempt id makes every publish attempt write its own objects, so a crashed or racing
  attempt can never leave bytes that a later attempt's manifest would describe wrongly.
* ``v{version:08d}/manifest.json``: written create-only after all shards; its existence is the
  commit (format 2, below; format 1, the full-snapshot-only layout of earlier runs, is still
  read).
* ``LATEST``: ``{"version", "epoch"}``, moved by CAS, forward only.
* ``EPOCH``: the trainer fencing token, incremented by CAS in ``acquire_epoch``.

A version holds a *full* snapshot, a *delta* against version ``base`` (= version - 1: the XOR
of bit patterns, zstd-compressed), or both. Its manifest names ``anchor``, the nearest full
snapshot at or below it: version ``v`` is rebuilt from the full snapshot of ``anchor`` and the
deltas ``anchor + 1 .. v``, or from a version ``h`` a reader already holds and the deltas
``h + 1 .. v``. Per tensor the manifest records the crc32c of every reconstructed piece, so a
reader verifies what it rebuilt, not only what it downloaded; a chain with a hole, or a piece
that fails, sends the reader back to the anchor, and a version that cannot be rebuilt is
refused (the caller keeps the weights it has).

Fencing: ``acquire_epoch`` also stamps its epoch into LATEST, and LATEST is only ever moved by
CAS from a value whose epoch is not newer than the writer's. A trainer that lost its epoch
(a zombie) therefore cannot move LATEST once the new trainer has acquired, even if it passed
its own epoch checks just before.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import random
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import numpy as np

from pipeline import weight_codec
from pipeline.storage import LocalStore, ObjectNotFound, ObjectStore, StorageError, safe_name

__all__ = [
    "CorruptSnapshotError",
    "DEFAULT_SHARD_BYTES",
    "ParamServer",
    "ParamServerError",
    "Snapshot",
    "SnapshotNotFoundError",
    "StaleEpochError",
]

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 64 << 20
DEFAULT_RANGE_BYTES = 16 << 20  # one ranged read of a remote shard (parallel reads saturate a link)
MANIFEST_FORMAT = 2
_WEIGHTS = "weights"
_LATEST = "LATEST"
_EPOCH = "EPOCH"
_MANIFEST = "manifest.json"
_REFUSED = "refused"  # weights/refused/v{version:08d}-{reader}.json: a reader's refusal
_MANIFEST_RE = re.compile(r"^v(\d{8})/manifest\.json$")
_VERSION_DIR_RE = re.compile(r"^v(\d{8})/")
_MAX_VERSION = 10**8 - 1  # the layout has 8 digits


class ParamServerError(Exception):
    """Base class of parameter-server errors."""


class StaleEpochError(ParamServerError):
    """A newer trainer epoch exists; this trainer must stop publishing."""


class CorruptSnapshotError(ParamServerError):
    """A committed snapshot failed verification (missing shard, wrong size or crc32c)."""


class SnapshotNotFoundError(ParamServerError, LookupError):
    """No committed snapshot for the requested version (or no LATEST yet)."""


@dataclass(frozen=True)
class Snapshot:
    """A verified snapshot. Arrays are read-only views over the downloaded shard bytes (for a
    local store, over read-only memory maps of the shard files)."""

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

    @classmethod
    def of(
        cls,
        version: int,
        tensors: dict[str, np.ndarray],
        split: dict[str, int | None] | None = None,
        parts: int = 1,
    ) -> Snapshot:
        """A complete snapshot of tensors in hand (e.g. what a trainer just published), cut
        into pieces as ``publish`` cuts them: a base for the next version's delta."""
        axes = split_axes_of(tensors, split, parts)
        pieces = {}
        for name, arr in tensors.items():
            for r, piece in enumerate(weight_codec.split_pieces(arr, axes[name], parts)):
                pieces[(name, r)] = piece
        return cls(version=version, tensors=dict(tensors), pieces=pieces)


def split_axes_of(
    tensors: dict[str, Any], split: dict[str, int | None] | None, parts: int
) -> dict[str, int | None]:
    """{name: the axis a tensor is cut along into ``parts`` pieces, or None (one piece)}:
    ``split``'s entry, or None when there is one part or no entry."""
    return {name: (split or {}).get(name) if parts > 1 else None for name in tensors}


def _version_dir(version: int) -> str:
    return f"v{version:08d}"


def _manifest_key(version: int) -> str:
    return f"{_version_dir(version)}/{_MANIFEST}"


def _crc32c(data: bytes) -> int:
    return int(google_crc32c.value(data))


def _resolve_dtype(name: str) -> np.dtype:
    """dtype from its manifest name; extension types (bfloat16, float8_*) come from ml_dtypes."""
    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        import ml_dtypes
    except ImportError as exc:
        raise TypeError(f"dtype {name!r} needs ml_dtypes, which is not installed") from exc
    try:
        return np.dtype(getattr(ml_dtypes, name))
    except AttributeError:
        raise TypeError(
            f"unknown dtype {name!r}: not a numpy dtype nor an ml_dtypes type"
        ) from None


def _check_array(name: str, arr: Any) -> np.ndarray:
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
        same = _resolve_dtype(arr.dtype.name) == arr.dtype.newbyteorder("=")
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


def _plan_shards(sizes: dict[Any, tuple[str, int]], shard_bytes: int) -> list[tuple[str, list]]:
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


def _group(part: int | None) -> str:
    return "all" if part is None else f"r{part:03d}"


def _normalize(manifest: dict[str, Any]) -> dict[str, Any]:
    """A format-1 manifest (full snapshot, no pieces) in format 2's shape."""
    if manifest.get("format", 1) >= 2:
        return manifest
    shards = [{**s, "part": None} for s in manifest["shards"]]
    return {
        **manifest,
        "parts": 1,
        "anchor": manifest["version"],
        "base": None,
        "tensors": [
            {
                "name": t["name"],
                "shape": t["shape"],
                "dtype": t["dtype"],
                "axis": None,
                "crc32c": None,
            }  # fmt: skip
            for t in manifest["tensors"]
        ],
        "full": {
            "shards": shards,
            "pieces": [
                {
                    "name": t["name"],
                    "part": 0,
                    "shard": t["shard"],
                    "offset": t["offset"],
                    "nbytes": t["nbytes"],
                }  # fmt: skip
                for t in manifest["tensors"]
            ],
        },
    }


class ParamServer:
    """Weight snapshots of one run. ``store`` is rooted at the run (``{root}/{run_id}``)."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        max_workers: int = 8,
        range_bytes: int = DEFAULT_RANGE_BYTES,
    ) -> None:
        """``max_workers``: parallel uploads and (ranged) downloads; ``range_bytes``: the size
        of one ranged read of a remote shard."""
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if range_bytes <= 0:
            raise ValueError(f"range_bytes must be positive, got {range_bytes}")
        self.store = store
        self._w = store.child(_WEIGHTS)
        self.shard_bytes = shard_bytes
        self.max_workers = max_workers
        self.range_bytes = range_bytes

    # ------------------------------------------------------------------ epochs

    def current_epoch(self) -> int:
        """The newest acquired epoch (0 if none)."""
        try:
            return self._parse_epoch(self._w.read(_EPOCH))
        except ObjectNotFound:
            return 0

    def acquire_epoch(self) -> int:
        """Become the publishing trainer: CAS-increment EPOCH, then fence LATEST with it."""
        owner = uuid.uuid4().hex  # makes our EPOCH bytes unique, so a retried CAS is exact
        rng = random.Random()
        while True:
            current = self._w.read_versioned(_EPOCH)
            epoch, generation = (
                (0, None)
                if current is None
                else (
                    self._parse_epoch(current[0]),
                    current[1],
                )
            )
            body = {"epoch": epoch + 1, "owner": owner, "acquired": time.time()}
            if self._w.compare_and_swap(_EPOCH, _dumps(body), generation):
                break
            time.sleep(rng.uniform(0.0, 0.01))  # another trainer raced us; re-read
        self._fence_latest(epoch + 1)
        return epoch + 1

    def _check_epoch(self, epoch: int) -> None:
        current = self.current_epoch()
        if current > epoch:
            raise StaleEpochError(
                f"epoch {epoch} is stale: {self._w.url_of(_EPOCH)} is at {current}; "
                "a newer trainer owns this run"
            )
        if current < epoch:
            raise ValueError(
                f"epoch {epoch} was never acquired ({self._w.url_of(_EPOCH)} is at {current}); "
                "call acquire_epoch() and publish with the epoch it returns"
            )

    def _fence_latest(self, epoch: int) -> None:
        """Stamp ``epoch`` into LATEST (version unchanged) so older epochs cannot move it."""
        while True:
            current = self._w.read_versioned(_LATEST)
            if current is None:
                body = {"version": None, "epoch": epoch}
                if self._w.compare_and_swap(_LATEST, _dumps(body), None):
                    return
                continue
            pointer = self._parse_latest(current[0])
            if pointer["epoch"] >= epoch:
                return
            body = {"version": pointer["version"], "epoch": epoch}
            if self._w.compare_and_swap(_LATEST, _dumps(body), current[1]):
                return

    # ------------------------------------------------------------------ publish

    def publish(
        self,
        version: int,
        tensors: dict[str, np.ndarray],
        *,
        epoch: int,
        metadata: dict[str, Any] | None = None,
        base: Snapshot | None = None,
        full: bool = True,
        split: dict[str, int | None] | None = None,
        parts: int = 1,
        full_every: int = 1,
    ) -> bool:
        """Commit ``tensors`` as ``version`` and move LATEST forward to it.

        ``full``: store a full snapshot. ``base``: also store a delta against it (a complete
        snapshot of ``version - 1``, committed: its manifest gives this version's anchor);
        at least one of the two. ``split``/``parts``: the split axis of each tensor the
        sampler's mesh splits over its ``parts`` tensor ranks (``tpu_jobs.mesh.split_axes``;
        absent or None: replicated). ``full_every``: recorded for readers (how far back a held
        version is still worth rebuilding from).

        Returns False (writing nothing) if ``version`` is already committed (a retry); LATEST is
        still moved forward to it, so on return ``version`` is committed and LATEST >= it.
        Raises StaleEpochError if a newer epoch exists, checked before writing, before the
        manifest and before moving LATEST (which is also fenced by CAS, see module doc).
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"version must be an int, got {version!r}")
        if not 0 <= version <= _MAX_VERSION:
            raise ValueError(f"version must be in [0, {_MAX_VERSION}], got {version}")
        if not isinstance(tensors, dict) or not tensors:
            raise ValueError("tensors must be a non-empty dict of name -> numpy.ndarray")
        if not full and base is None:
            raise ValueError("publish needs full=True or a base to store a delta against")
        if parts < 1 or full_every < 1:
            raise ValueError(f"parts and full_every must be >= 1, got {parts}, {full_every}")
        metadata = dict(metadata or {})
        _dumps(metadata)  # fail early on metadata that is not JSON-serialisable
        arrays = {name: _check_array(name, arr) for name, arr in tensors.items()}
        axes = split_axes_of(arrays, split, parts)
        pieces = Snapshot.of(version, arrays, split, parts).pieces
        if base is not None:
            self._check_base(version, base, pieces)

        self._check_epoch(epoch)
        existing = self._read_manifest_or_none(version)
        if existing is not None:
            return self._already_committed(version, existing, epoch)
        anchor = version if full else self._anchor_of(base.version)  # type: ignore[union-attr]

        attempt = uuid.uuid4().hex[:12]
        groups = {pid: _group(pid[1] if axes[pid[0]] is not None else None) for pid in pieces}
        manifest: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "version": version,
            "epoch": epoch,
            "attempt": attempt,
            "created": time.time(),
            "metadata": metadata,
            "parts": parts,
            "anchor": anchor,
            "base": None if base is None else base.version,
            "full_every": full_every,
            "tensors": [
                {
                    "name": name,
                    "shape": list(arr.shape),
                    "dtype": arr.dtype.name,
                    "axis": axes[name],
                    "crc32c": [
                        _crc32c(_bytes_of(pieces[(name, r)]))
                        for r in range(parts if axes[name] is not None else 1)
                    ],
                }
                for name, arr in sorted(arrays.items())
            ],
        }
        written: list[str] = []
        if full:
            manifest["full"] = self._write_pieces(version, "full", attempt, pieces, groups, written)
        if base is not None:
            with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
                blobs = dict(
                    zip(
                        pieces,
                        pool.map(
                            lambda pid: weight_codec.encode_delta(pieces[pid], base.pieces[pid]),
                            pieces,
                        ),
                        strict=True,
                    )
                )
            manifest["delta"] = {
                "codec": weight_codec.CODEC,
                **self._write_pieces(version, "delta", attempt, blobs, groups, written),
            }

        # A newer trainer may have taken over while we uploaded; do not commit for it.
        self._check_epoch(epoch)
        if not self._write_manifest(version, manifest):
            # Someone committed this version while we uploaded: drop our shards, defer to theirs.
            for key in written:
                self._w.delete(key)
            return self._already_committed(version, self._read_manifest(version), epoch)
        self._check_epoch(epoch)
        self._advance_latest(version, epoch)
        return True

    def _check_base(
        self, version: int, base: Snapshot, pieces: dict[tuple[str, int], np.ndarray]
    ) -> None:
        if base.version != version - 1 or base.ranks is not None:
            raise ValueError(
                f"a delta of v{version} needs a complete snapshot of v{version - 1} as its "
                f"base, got v{base.version}" + (" (some ranks only)" if base.ranks else "")
            )
        for pid, piece in pieces.items():
            old = base.pieces.get(pid)
            if old is None or old.shape != piece.shape or old.dtype != piece.dtype:
                raise ValueError(
                    f"base v{base.version} does not match v{version}'s piece {pid}: "
                    f"{None if old is None else (old.shape, old.dtype)} vs "
                    f"{(piece.shape, piece.dtype)}; allowed: the same tensors, dtypes and split"
                )

    def _anchor_of(self, version: int) -> int:
        """The anchor (nearest full snapshot) of committed ``version``."""
        manifest = _normalize(self._read_manifest(version))
        return int(manifest["anchor"])

    def _write_pieces(
        self,
        version: int,
        kind: str,
        attempt: str,
        payloads: dict[tuple[str, int], Any],
        groups: dict[tuple[str, int], str],
        written: list[str],
    ) -> dict[str, Any]:
        """Upload ``payloads`` (arrays or bytes, by piece id) as shard objects; the
        manifest's {"shards", "pieces"} for them. Keys written are appended to ``written``."""
        sizes = {pid: (groups[pid], _nbytes(p)) for pid, p in payloads.items()}
        plan = _plan_shards(sizes, self.shard_bytes)
        keys = [
            f"{_version_dir(version)}/{kind}-{group}-{i:05d}-{attempt}.bin"
            for i, (group, _) in enumerate(plan)
        ]

        def write_shard(i: int) -> dict[str, Any]:
            group, pids = plan[i]
            data = self._shard_payload([payloads[pid] for pid in pids])
            if not self._w.write_new(keys[i], data):
                raise StorageError(f"shard {self._w.url_of(keys[i])} already exists")
            written.append(keys[i])
            part = None if group == "all" else int(group[1:])
            return {"key": keys[i], "size": _nbytes(data), "crc32c": _crc32c(data), "part": part}

        with ThreadPoolExecutor(max_workers=self._writers(len(plan))) as pool:
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

    def _writers(self, shards: int) -> int:
        """Upload threads. Local writes are memory copies into the page cache: beyond about
        two per CPU, threads only contend (measured in benchmarks/paramserver.py)."""
        workers = min(self.max_workers, shards)
        if isinstance(self._w, LocalStore):
            cpus = (
                len(os.sched_getaffinity(0))
                if hasattr(os, "sched_getaffinity")
                else (os.cpu_count() or 1)
            )
            workers = min(workers, 2 * cpus)
        return max(1, workers)

    def _shard_payload(self, payloads: list[Any]) -> Any:
        """The bytes of one shard. A lone array going to a ``LocalStore`` is passed as a view
        of the array itself (it writes any buffer); other stores get ``bytes``."""
        if len(payloads) == 1:
            if isinstance(payloads[0], bytes):
                return payloads[0]
            flat = _bytes_of(payloads[0])  # a view: the array is C-contiguous
            return flat if isinstance(self._w, LocalStore) else flat.tobytes()
        return b"".join(_bytes_of(p) for p in payloads)

    def _write_manifest(self, version: int, manifest: dict[str, Any]) -> bool:
        """The commit point: create-only."""
        return self._w.write_new(_manifest_key(version), _dumps(manifest))

    def _already_committed(self, version: int, manifest: dict[str, Any], epoch: int) -> bool:
        # Committed snapshots are complete and verified, whoever wrote them; finish what the
        # committing attempt may not have (a crash before LATEST moved) so that after publish
        # returns, ``version`` is committed and LATEST >= ``version``.
        if manifest.get("epoch") != epoch:
            log.info(
                "version %d was committed by epoch %s; kept as is (publisher epoch %d)",
                version,
                manifest.get("epoch"),
                epoch,
            )
        self._check_epoch(epoch)
        self._advance_latest(version, epoch)
        return False

    def _advance_latest(self, version: int, epoch: int) -> None:
        """CAS LATEST to ``version``; never backwards, never over a newer epoch's pointer."""
        while True:
            current = self._w.read_versioned(_LATEST)
            generation = None
            if current is not None:
                pointer = self._parse_latest(current[0])
                generation = current[1]
                if pointer["epoch"] > epoch:
                    raise StaleEpochError(
                        f"epoch {epoch} is stale: {self._w.url_of(_LATEST)} was fenced by epoch "
                        f"{pointer['epoch']}; not moving it to version {version}"
                    )
                if pointer["version"] is not None and pointer["version"] >= version:
                    return
            body = {"version": version, "epoch": epoch, "updated": time.time()}
            if self._w.compare_and_swap(_LATEST, _dumps(body), generation):
                return

    # ------------------------------------------------------------------ read side

    def latest_version(self) -> int | None:
        try:
            return self._parse_latest(self._w.read(_LATEST))["version"]
        except ObjectNotFound:
            return None

    def versions(self) -> list[int]:
        """Committed versions (those with a manifest), ascending."""
        found = []
        for key in self._w.list("v"):
            m = _MANIFEST_RE.match(key)
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def manifest(self, version: int) -> dict[str, Any]:
        """The committed manifest of ``version`` (SnapshotNotFoundError if not committed)."""
        return self._read_manifest(version)

    def pull(
        self,
        version: int | None = None,
        *,
        have: Snapshot | None = None,
        ranks: Any = None,
    ) -> Snapshot:
        """Download, rebuild and verify a version (default: LATEST).

        ``have``: a snapshot this reader holds (of the same ``ranks``); a newer version is then
        rebuilt from it with the deltas in between when they exist, else (a hole, a delta that
        fails) from the version's anchor. ``ranks``: the tensor ranks of the sampler's mesh
        this host holds (``tpu_jobs.mesh.tensor_ranks``; None: all): only their pieces and
        the unsplit tensors are downloaded.

        Raises SnapshotNotFoundError if it is not committed and CorruptSnapshotError (naming
        the shard or piece and the expected/actual size and crc32c) if it cannot be rebuilt;
        ``have`` is never modified.
        """
        if version is None:
            version = self.latest_version()
            if version is None:
                raise SnapshotNotFoundError(
                    f"no version published yet under {self._w.url} (LATEST missing or empty)"
                )
        want = None if ranks is None else frozenset(int(r) for r in ranks)
        if want is not None and not want:
            raise ValueError("ranks must name at least one tensor rank (or be None: all)")
        manifest = self._read_normalized(version)
        if want is not None and int(manifest["parts"]) > 1:
            bad = sorted(r for r in want if not 0 <= r < int(manifest["parts"]))
            if bad:
                raise ValueError(
                    f"ranks {bad} do not exist: v{version} is split into {manifest['parts']} "
                    f"tensor ranks (allowed: 0..{int(manifest['parts']) - 1})"
                )
        if have is not None and have.ranks == want and have.version == version:
            return have
        anchor = int(manifest["anchor"])
        span = int(manifest.get("full_every", 1))
        if have is not None and have.ranks == want and anchor - span <= have.version < version:
            try:
                return self._rebuild(version, manifest, have, want)
            except (CorruptSnapshotError, SnapshotNotFoundError) as err:
                log.warning(
                    "rebuilding v%d from held v%d failed (%s); starting from full snapshot v%d",
                    version,
                    have.version,
                    err,
                    anchor,
                )
        return self._rebuild(version, manifest, None, want)

    def _rebuild(
        self,
        version: int,
        manifest: dict[str, Any],
        have: Snapshot | None,
        want: frozenset[int] | None,
    ) -> Snapshot:
        """``version`` from ``have`` (or, None, from the anchor's full snapshot) and the
        deltas in between, every piece verified against its manifest's crc32c."""
        start = int(manifest["anchor"]) if have is None else have.version + 1
        chain = list(range(start, version + 1))
        earlier = chain[:-1]  # the target's manifest is in hand
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(chain)))) as pool:
            manifests = dict(zip(earlier, pool.map(self._read_normalized, earlier), strict=True))
        manifests[version] = manifest
        for v in chain if have is not None else chain[1:]:
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
        if have is None and "full" not in manifests[start]:
            raise CorruptSnapshotError(f"v{version}'s anchor v{start} holds no full snapshot")

        # Every shard of the chain is fetched in one pool (ranged reads for remote stores).
        jobs = []
        for v in chain:
            for kind in ("full",) if (have is None and v == start) else ("delta",):
                spec = manifests[v][kind]
                for i, shard in enumerate(spec["shards"]):
                    if want is None or shard.get("part") is None or shard["part"] in want:
                        jobs.append((v, kind, i, shard))
        data = dict(zip(((v, k, i) for v, k, i, _ in jobs), self._fetch(jobs), strict=True))

        pieces: dict[tuple[str, int], np.ndarray]
        if have is None:
            pieces = self._full_pieces(start, manifests[start], data, want)
            applied: list[int] = chain[1:]
        else:
            pieces = dict(have.pieces)
            applied = chain
        for v in applied:
            pieces = self._apply(v, manifests[v], data, pieces, want)
        return self._snapshot(
            manifests[version],
            pieces,
            want,
            full_from=start if have is None else None,
            deltas=tuple(applied),
        )

    def _wanted(self, manifest: dict[str, Any], want: frozenset[int] | None):
        """(tensor entry, part, piece shape) of each piece a reader of ``want`` needs."""
        parts = int(manifest["parts"])
        for t in manifest["tensors"]:
            shape = [int(d) for d in t["shape"]]
            axis = t.get("axis")
            if axis is None:
                yield t, 0, tuple(shape)
                continue
            shape[axis] //= parts
            for r in range(parts):
                if want is None or r in want:
                    yield t, r, tuple(shape)

    def _full_pieces(self, version, manifest, data, want) -> dict[tuple[str, int], np.ndarray]:
        where = {(p["name"], p["part"]): p for p in manifest["full"]["pieces"]}
        out = {}
        for t, r, shape in self._wanted(manifest, want):
            spec = where.get((t["name"], r))
            if spec is None:
                raise CorruptSnapshotError(f"v{version}: no full piece {r} of {t['name']!r}")
            buf = self._piece_bytes(version, "full", spec, data)
            out[(t["name"], r)] = self._view(version, t, shape, buf)
        return out

    def _apply(self, version, manifest, data, pieces, want) -> dict[tuple[str, int], np.ndarray]:
        where = {(p["name"], p["part"]): p for p in manifest["delta"]["pieces"]}

        def one(item: tuple[dict[str, Any], int, tuple]) -> tuple[tuple[str, int], np.ndarray]:
            t, r, shape = item
            pid = (t["name"], r)
            spec, old = where.get(pid), pieces.get(pid)
            dtype = _resolve_dtype(t["dtype"])
            if spec is None or old is None or old.shape != shape or old.dtype != dtype:
                raise CorruptSnapshotError(
                    f"v{version}: the delta of {t['name']!r} piece {r} does not fit its base "
                    f"({None if old is None else (old.shape, old.dtype)} vs {(shape, dtype)})"
                )
            blob = self._piece_bytes(version, "delta", spec, data)
            try:
                new, actual = weight_codec.apply_delta(blob, old, manifest["delta"]["codec"])
            except weight_codec.DeltaError as err:
                raise CorruptSnapshotError(f"v{version}: {t['name']!r} piece {r}: {err}") from None
            want_crc = int(t["crc32c"][r if t.get("axis") is not None else 0])
            if actual != want_crc:
                raise CorruptSnapshotError(
                    f"v{version}: rebuilt {t['name']!r} piece {r} failed verification: expected "
                    f"crc32c {want_crc:08x}, got {actual:08x} (a wrong base or a bad delta)"
                )
            new.flags.writeable = False
            return pid, new

        # Pieces in parallel: zstd, NumPy's copies and crc32c release the GIL.
        items = list(self._wanted(manifest, want))
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(items)))) as pool:
            return dict(pool.map(one, items))

    def _piece_bytes(self, version: int, kind: str, spec: dict[str, Any], data) -> Any:
        try:
            buf = data[(version, kind, int(spec["shard"]))]
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

    def _view(self, version: int, t: dict[str, Any], shape: tuple, buf: Any) -> np.ndarray:
        try:
            dtype = _resolve_dtype(t["dtype"])
        except (KeyError, TypeError) as exc:
            raise CorruptSnapshotError(
                f"snapshot v{version}: bad tensor entry {t!r}: {exc}"
            ) from None
        count = math.prod(shape)
        if count * dtype.itemsize != len(buf):
            raise CorruptSnapshotError(
                f"snapshot v{version}: tensor {t['name']!r} ({shape}, {dtype}) does not fit "
                f"its {len(buf)} stored bytes"
            )
        return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)

    def _snapshot(self, manifest, pieces, want, *, full_from, deltas) -> Snapshot:
        tensors: dict[str, np.ndarray] = {}
        for t in manifest["tensors"]:
            axis = t.get("axis")
            held = [pieces[(t["name"], r)] for r in range(int(manifest["parts"]))
                    if (t["name"], r) in pieces]  # fmt: skip
            tensors[t["name"]] = weight_codec.join_pieces(held, axis)
        return Snapshot(
            version=int(manifest["version"]),
            tensors=tensors,
            metadata=manifest.get("metadata", {}),
            epoch=manifest.get("epoch", 0),
            created=manifest.get("created", 0.0),
            ranks=want,
            pieces=pieces,
            full_from=full_from,
            deltas=deltas,
        )

    def _fetch(self, jobs: list[tuple[int, str, int, dict[str, Any]]]) -> list[Any]:
        """The verified bytes of each (version, kind, index, shard spec): ranged reads of
        ``range_bytes`` each, all in one pool of ``max_workers`` (the pull concurrency)."""
        ranges = []  # (job index, start, length)
        for j, (_, _, _, spec) in enumerate(jobs):
            size = int(spec["size"])
            if isinstance(self._w, LocalStore) or size <= self.range_bytes:
                ranges.append((j, 0, -1))
            else:
                ranges += [(j, a, min(self.range_bytes, size - a))
                           for a in range(0, size, self.range_bytes)]  # fmt: skip

        def read(item: tuple[int, int, int]) -> Any:
            j, a, n = item
            v, key = jobs[j][0], jobs[j][3]["key"]
            try:
                return self._read_shard(key) if n < 0 else self._w.read_range(key, a, n)
            except ObjectNotFound:
                raise CorruptSnapshotError(
                    f"snapshot v{v}: shard {self._w.url_of(key)} is missing"
                ) from None

        workers = max(1, min(self.max_workers, len(ranges)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            got = list(pool.map(read, ranges))
        bufs: list[Any] = [None] * len(jobs)
        chunks: dict[int, list[bytes]] = {}
        for (j, _, n), buf in zip(ranges, got, strict=True):
            if n < 0:
                bufs[j] = buf
            else:
                chunks.setdefault(j, []).append(buf)
        for j, parts in chunks.items():
            bufs[j] = b"".join(parts)
        for (v, _, _, spec), buf in zip(jobs, bufs, strict=True):
            actual = _crc32c(buf)
            if len(buf) != spec["size"] or actual != spec["crc32c"]:
                raise CorruptSnapshotError(
                    f"snapshot v{v}: shard {self._w.url_of(spec['key'])} failed verification: "
                    f"expected crc32c {spec['crc32c']:08x} over {spec['size']} bytes, got "
                    f"crc32c {actual:08x} over {len(buf)} bytes"
                )
        return bufs

    def _read_shard(self, key: str) -> Any:
        """A shard's bytes. From a ``LocalStore``: a read-only memory map of the object's file
        (objects there are immutable files, replaced only by linking or renaming new ones, so
        the map stays valid and unchanged, even after the object is deleted), which spares a
        pull one copy and the page faults of fresh memory. From other stores: ``bytes``."""
        if not isinstance(self._w, LocalStore):
            return self._w.read(key)
        try:
            f = open(self._w.path_of(key), "rb")  # noqa: SIM115 - closed below, the map stays
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(self._w.url_of(key)) from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return b""  # an empty file cannot be mapped
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapped = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
        return np.frombuffer(mapped, dtype=np.uint8)

    def wait_for_version(
        self, min_version: int, timeout: float | None = None, poll: float = 1.0
    ) -> int:
        """Block until LATEST >= ``min_version``; returns it. TimeoutError after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            latest = self.latest_version()
            if latest is not None and latest >= min_version:
                return latest
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"LATEST at {self._w.url_of(_LATEST)} is {latest}, still below "
                    f"{min_version} after {timeout}s"
                )
            remaining = math.inf if deadline is None else deadline - time.monotonic()
            time.sleep(max(0.0, min(poll, remaining)))

    # ------------------------------------------------------------------ retention

    # ------------------------------------------------------------------ healing

    def report_refused(self, version: int, reader: str, reason: str) -> None:
        """A reader (a rollout worker) could not use ``version`` (missing or failing
        verification): leave a marker the trainer acts on (`refused`, `repair`)."""
        record = {"version": version, "reader": reader, "reason": reason, "time": time.time()}
        key = f"{_REFUSED}/{_version_dir(version)}-{safe_name(reader, 'reader')[:100]}.json"
        self._w.write_new(key, _dumps(record))

    def refused(self) -> dict[int, list[str]]:
        """{version: [reasons]} of the refusal markers."""
        out: dict[int, list[str]] = {}
        for key in self._w.list(f"{_REFUSED}/"):
            try:
                record = json.loads(self._w.read(key))
                out.setdefault(int(record["version"]), []).append(str(record["reason"]))
            except (ObjectNotFound, ValueError, KeyError, TypeError):
                continue
        return out

    def repair(
        self,
        version: int,
        tensors: dict[str, np.ndarray],
        *,
        epoch: int,
        metadata: dict[str, Any] | None = None,
        **layout: Any,
    ) -> None:
        """Rewrite ``version`` from ``tensors`` (the very tensors it was published from:
        only the trainer holding them may call this) as a full snapshot, and clear its
        refusal markers. The manifest is deleted first, so no reader ever sees a mix of old
        and new shards. ``layout``: ``split``, ``parts``, ``full_every`` as for ``publish``.
        Rewritten with the same bits, the version stays a valid base for later deltas."""
        self._check_epoch(epoch)
        self._w.delete(_manifest_key(version))
        for key in self._w.list(f"{_version_dir(version)}/"):
            self._w.delete(key)
        self.publish(version, tensors, epoch=epoch, metadata=metadata, full=True, **layout)
        for key in self._w.list(f"{_REFUSED}/{_version_dir(version)}-"):
            self._w.delete(key)

    def gc(self, keep_last: int, protected: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Delete committed versions except the newest ``keep_last``, LATEST and ``protected``,
        and the links each of those needs (its anchor's full snapshot and the deltas after it).

        The manifest goes first, so a half-deleted snapshot is never seen as committed. Also
        removes uncommitted leftovers (shards of crashed attempts) of versions older than the
        oldest kept one, and shards of losing attempts inside kept versions. Returns the
        deleted committed versions, ascending.
        """
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        keys = self._w.list("v")
        by_version: dict[int, list[str]] = {}
        for key in keys:
            m = _VERSION_DIR_RE.match(key)
            if m:
                by_version.setdefault(int(m.group(1)), []).append(key)
        committed = sorted(v for v, ks in by_version.items() if _manifest_key(v) in ks)
        latest = self.latest_version()
        keep = set(committed[max(0, len(committed) - keep_last) :] if keep_last else [])
        keep |= set(protected)
        if latest is not None:
            keep.add(latest)
        # A kept version needs its links: its anchor's full snapshot and the deltas after it.
        for v in sorted(keep & set(committed)):
            try:
                anchor = int(_normalize(self._read_manifest(v))["anchor"])
            except (SnapshotNotFoundError, CorruptSnapshotError, KeyError, TypeError, ValueError):
                continue  # unreadable: nothing to follow (a reader refuses it anyway)
            keep |= {u for u in committed if anchor <= u < v}
        doomed = [v for v in committed if v not in keep]
        for v in doomed:
            self._w.delete(_manifest_key(v))
            for key in by_version[v]:
                if key != _manifest_key(v):
                    self._w.delete(key)

        kept = [v for v in committed if v in keep]
        oldest_kept = min(kept) if kept else None
        for v, ks in by_version.items():
            if v in committed:
                continue
            if oldest_kept is not None and v < oldest_kept:
                for key in ks:
                    self._w.delete(key)
        for v in kept:
            try:
                manifest = _normalize(self._read_manifest(v))
                referenced = {
                    s["key"]
                    for kind in ("full", "delta")
                    for s in manifest.get(kind, {}).get("shards", [])
                }
            except (SnapshotNotFoundError, CorruptSnapshotError, KeyError, TypeError):
                continue
            for key in by_version[v]:
                if key != _manifest_key(v) and key not in referenced:
                    self._w.delete(key)
        return doomed

    # ------------------------------------------------------------------ parsing

    def _read_manifest_or_none(self, version: int) -> dict[str, Any] | None:
        try:
            return self._read_manifest(version)
        except SnapshotNotFoundError:
            return None

    def _read_normalized(self, version: int) -> dict[str, Any]:
        manifest = self._read_manifest(version)
        try:
            return _normalize(manifest)
        except (KeyError, TypeError) as exc:
            raise CorruptSnapshotError(
                f"manifest {self._w.url_of(_manifest_key(version))} lacks {exc}"
            ) from None

    def _read_manifest(self, version: int) -> dict[str, Any]:
        key = _manifest_key(version)
        try:
            raw = self._w.read(key)
        except ObjectNotFound:
            raise SnapshotNotFoundError(
                f"version {version} is not committed: {self._w.url_of(key)} does not exist"
            ) from None
        try:
            manifest = json.loads(raw)
        except ValueError as exc:
            raise CorruptSnapshotError(
                f"manifest {self._w.url_of(key)} is not JSON: {exc}"
            ) from None
        if not isinstance(manifest, dict) or manifest.get("version") != version:
            raise CorruptSnapshotError(
                f"manifest {self._w.url_of(key)} describes version "
                f"{manifest.get('version') if isinstance(manifest, dict) else manifest!r}, "
                f"expected {version}"
            )
        return manifest

    def _parse_epoch(self, raw: bytes) -> int:
        try:
            epoch = json.loads(raw)["epoch"]
            if isinstance(epoch, int):
                return epoch
        except (ValueError, KeyError, TypeError):
            pass
        raise ParamServerError(f"{self._w.url_of(_EPOCH)} holds unreadable data {raw[:100]!r}")

    def _parse_latest(self, raw: bytes) -> dict[str, Any]:
        try:
            pointer = json.loads(raw)
            version, epoch = pointer["version"], pointer.get("epoch", 0)
            if (version is None or isinstance(version, int)) and isinstance(epoch, int):
                return {"version": version, "epoch": epoch}
        except (ValueError, KeyError, TypeError):
            pass
        raise ParamServerError(f"{self._w.url_of(_LATEST)} holds unreadable data {raw[:100]!r}")


def _bytes_of(payload: Any) -> Any:
    """The bytes of an array (a flat uint8 view; the array is C-contiguous) or of bytes."""
    if isinstance(payload, np.ndarray):
        return payload.reshape(-1).view(np.uint8)
    return payload


def _nbytes(payload: Any) -> int:
    return payload.nbytes if isinstance(payload, np.ndarray) else len(payload)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
