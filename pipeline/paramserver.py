"""Versioned weight snapshots in object storage: the trainer publishes, rollout workers pull.

Layout under the run's store (``weights/``):

* ``v{version:08d}/shard-{i:05d}-{attempt}.bin``: raw tensor bytes, concatenated. The attempt
  id makes every publish attempt write its own objects, so a crashed or racing attempt can
  never leave bytes that a later attempt's manifest would describe wrongly.
* ``v{version:08d}/manifest.json``: written create-only after all shards; its existence is the
  commit. Per tensor: name, shape, dtype, shard, offset, nbytes. Per shard: key, size, crc32c.
* ``LATEST``: ``{"version", "epoch"}``, moved by CAS, forward only.
* ``EPOCH``: the trainer fencing token, incremented by CAS in ``acquire_epoch``.

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
MANIFEST_FORMAT = 1
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


def _plan_shards(tensors: dict[str, np.ndarray], shard_bytes: int) -> list[list[str]]:
    """Group tensor names (sorted, so layout is deterministic) into shards of ~shard_bytes.

    A tensor is never split. One of at least ``shard_bytes // 16`` (4 MiB by default) gets a
    shard of its own: its bytes are then written straight from the array, never copied into a
    shard buffer, and nearly all of a model's bytes are in such tensors; the small ones (norms,
    biases) share shards.
    """
    solo = max(1, shard_bytes // 16)
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if nbytes >= solo:
            shards.append([name])
            continue
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


class ParamServer:
    """Weight snapshots of one run. ``store`` is rooted at the run (``{root}/{run_id}``)."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        max_workers: int = 8,
    ) -> None:
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.store = store
        self._w = store.child(_WEIGHTS)
        self.shard_bytes = shard_bytes
        self.max_workers = max_workers

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
    ) -> bool:
        """Commit ``tensors`` as ``version`` and move LATEST forward to it.

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
        metadata = dict(metadata or {})
        _dumps(metadata)  # fail early on metadata that is not JSON-serialisable
        arrays = {name: _check_array(name, arr) for name, arr in tensors.items()}

        self._check_epoch(epoch)
        existing = self._read_manifest_or_none(version)
        if existing is not None:
            return self._already_committed(version, existing, epoch)

        attempt = uuid.uuid4().hex[:12]
        plan = _plan_shards(arrays, self.shard_bytes)
        keys = [f"{_version_dir(version)}/shard-{i:05d}-{attempt}.bin" for i in range(len(plan))]

        def write_shard(i: int) -> dict[str, Any]:
            data = self._shard_payload([arrays[name] for name in plan[i]])
            if not self._w.write_new(keys[i], data):
                raise StorageError(f"shard {self._w.url_of(keys[i])} already exists")
            return {"key": keys[i], "size": len(data), "crc32c": _crc32c(data)}

        with ThreadPoolExecutor(max_workers=self._writers(len(plan))) as pool:
            shards = list(pool.map(write_shard, range(len(plan))))

        entries = []
        for shard_index, names in enumerate(plan):
            offset = 0
            for name in names:
                arr = arrays[name]
                entries.append(
                    {
                        "name": name,
                        "shape": list(arr.shape),
                        "dtype": arr.dtype.name,
                        "shard": shard_index,
                        "offset": offset,
                        "nbytes": arr.nbytes,
                    }
                )
                offset += arr.nbytes
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": version,
            "epoch": epoch,
            "attempt": attempt,
            "created": time.time(),
            "metadata": metadata,
            "shards": shards,
            "tensors": entries,
        }

        # A newer trainer may have taken over while we uploaded; do not commit for it.
        self._check_epoch(epoch)
        if not self._write_manifest(version, manifest):
            # Someone committed this version while we uploaded: drop our shards, defer to theirs.
            for key in keys:
                self._w.delete(key)
            return self._already_committed(version, self._read_manifest(version), epoch)
        self._check_epoch(epoch)
        self._advance_latest(version, epoch)
        return True

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

    def _shard_payload(self, arrays: list[np.ndarray]) -> Any:
        """The bytes of one shard. A lone tensor going to a ``LocalStore`` is passed as a view
        of the array itself (it writes any buffer); other stores get ``bytes``."""
        if len(arrays) == 1:
            flat = arrays[0].reshape(-1).view(np.uint8)  # a view: the array is C-contiguous
            return flat if isinstance(self._w, LocalStore) else flat.tobytes()
        return b"".join(arr.reshape(-1).view(np.uint8) for arr in arrays)

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

    def pull(self, version: int | None = None) -> Snapshot:
        """Download and verify a snapshot (default: LATEST).

        Raises SnapshotNotFoundError if it is not committed and CorruptSnapshotError (naming
        the shard and the expected/actual size and crc32c) if any piece fails verification.
        """
        if version is None:
            version = self.latest_version()
            if version is None:
                raise SnapshotNotFoundError(
                    f"no version published yet under {self._w.url} (LATEST missing or empty)"
                )
        manifest = self._read_manifest(version)
        try:
            shard_specs = manifest["shards"]
            tensor_specs = manifest["tensors"]
        except KeyError as exc:
            raise CorruptSnapshotError(
                f"manifest {self._w.url_of(_manifest_key(version))} lacks {exc}"
            ) from None

        def fetch(spec: dict[str, Any]) -> Any:
            url = self._w.url_of(spec["key"])
            try:
                data = self._read_shard(spec["key"])
            except ObjectNotFound:
                raise CorruptSnapshotError(f"snapshot v{version}: shard {url} is missing") from None
            actual = _crc32c(data)
            if len(data) != spec["size"] or actual != spec["crc32c"]:
                raise CorruptSnapshotError(
                    f"snapshot v{version}: shard {url} failed verification: expected "
                    f"crc32c {spec['crc32c']:08x} over {spec['size']} bytes, got crc32c "
                    f"{actual:08x} over {len(data)} bytes"
                )
            return data

        workers = max(1, min(self.max_workers, len(shard_specs)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            shard_data = list(pool.map(fetch, shard_specs))

        tensors: dict[str, np.ndarray] = {}
        for spec in tensor_specs:
            tensors[spec["name"]] = self._tensor_view(version, spec, shard_data)
        return Snapshot(
            version=version,
            tensors=tensors,
            metadata=manifest.get("metadata", {}),
            epoch=manifest.get("epoch", 0),
            created=manifest.get("created", 0.0),
        )

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

    def _tensor_view(self, version: int, spec: dict[str, Any], shard_data: list[Any]) -> np.ndarray:
        try:
            dtype = _resolve_dtype(spec["dtype"])
            shape = tuple(int(d) for d in spec["shape"])
            data = shard_data[spec["shard"]]
            offset, nbytes = int(spec["offset"]), int(spec["nbytes"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise CorruptSnapshotError(
                f"snapshot v{version}: bad manifest entry {spec!r}: {exc}"
            ) from None
        count = math.prod(shape)
        if count * dtype.itemsize != nbytes or offset < 0 or offset + nbytes > len(data):
            raise CorruptSnapshotError(
                f"snapshot v{version}: tensor {spec['name']!r} ({shape}, {dtype}) does not fit "
                f"shard {spec['shard']} at offset {offset} with {nbytes} bytes"
            )
        return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)

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
    ) -> None:
        """Rewrite ``version`` from ``tensors`` (the very parameters it was published from:
        only the trainer holding them may call this) and clear its refusal markers. The
        manifest is deleted first, so no reader ever sees a mix of old and new shards."""
        self._check_epoch(epoch)
        self._w.delete(_manifest_key(version))
        for key in self._w.list(f"{_version_dir(version)}/"):
            self._w.delete(key)
        self.publish(version, tensors, epoch=epoch, metadata=metadata)
        for key in self._w.list(f"{_REFUSED}/{_version_dir(version)}-"):
            self._w.delete(key)

    def gc(self, keep_last: int, protected: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Delete committed versions except the newest ``keep_last``, LATEST and ``protected``.

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
                referenced = {s["key"] for s in self._read_manifest(v)["shards"]}
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


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
