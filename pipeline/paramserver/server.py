"""``ParamServer``: the weight versions of one run in its object store (layout, deltas and
fencing: ``pipeline/paramserver/__init__.py``)."""

from __future__ import annotations

import json
import logging
import math
import random
import time
import uuid
from typing import Any

import numpy as np

import pipeline.paramserver.publish as writing
from pipeline import weight_codec
from pipeline.paramserver.errors import (
    CorruptSnapshotError,
    SnapshotNotFoundError,
    StaleEpochError,
)
from pipeline.paramserver.manifest import (
    EPOCH,
    LATEST,
    MANIFEST_RE,
    MAX_VERSION,
    QUARANTINE,
    REFUSED,
    VERSION_DIR_RE,
    dumps,
    manifest_key,
    normalize,
    parse_epoch,
    parse_latest,
    read_manifest,
    read_normalized,
    version_dir,
)
from pipeline.paramserver.pull import BufferPool, rebuild
from pipeline.paramserver.snapshot import Snapshot
from pipeline.storage import ObjectNotFound, ObjectStore, safe_name

__all__ = ["DEFAULT_RANGE_BYTES", "DEFAULT_SHARD_BYTES", "ParamServer"]

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 64 << 20
DEFAULT_RANGE_BYTES = 16 << 20  # one ranged read of a remote shard (parallel reads saturate a link)
_WEIGHTS = "weights"


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
        """``max_workers``: parallel uploads and (ranged) downloads; ``range_bytes``: the most
        one ranged read of a remote shard asks for."""
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
        # The memory of the version a worker stopped using, for the next version it pulls.
        self._buffers = BufferPool(keep=1)

    # ------------------------------------------------------------------ epochs

    def current_epoch(self) -> int:
        """The newest acquired epoch (0 if none)."""
        try:
            return self._parse_epoch(self._w.read(EPOCH))
        except ObjectNotFound:
            return 0

    def acquire_epoch(self) -> int:
        """Become the publishing trainer: CAS-increment EPOCH, then fence LATEST with it."""
        owner = uuid.uuid4().hex  # makes our EPOCH bytes unique, so a retried CAS is exact
        rng = random.Random()
        while True:
            current = self._w.read_versioned(EPOCH)
            epoch, generation = (
                (0, None)
                if current is None
                else (
                    self._parse_epoch(current[0]),
                    current[1],
                )
            )
            body = {"epoch": epoch + 1, "owner": owner, "acquired": time.time()}
            if self._w.compare_and_swap(EPOCH, dumps(body), generation):
                break
            time.sleep(rng.uniform(0.0, 0.01))  # another trainer raced us; re-read
        self._fence_latest(epoch + 1)
        return epoch + 1

    def _check_epoch(self, epoch: int) -> None:
        current = self.current_epoch()
        if current > epoch:
            raise StaleEpochError(
                f"epoch {epoch} is stale: {self._w.url_of(EPOCH)} is at {current}; "
                "a newer trainer owns this run"
            )
        if current < epoch:
            raise ValueError(
                f"epoch {epoch} was never acquired ({self._w.url_of(EPOCH)} is at {current}); "
                "call acquire_epoch() and publish with the epoch it returns"
            )

    def _fence_latest(self, epoch: int) -> None:
        """Stamp ``epoch`` into LATEST (version unchanged) so older epochs cannot move it."""
        while True:
            current = self._w.read_versioned(LATEST)
            if current is None:
                body = {"version": None, "epoch": epoch}
                if self._w.compare_and_swap(LATEST, dumps(body), None):
                    return
                continue
            pointer = self._parse_latest(current[0])
            if pointer["epoch"] >= epoch:
                return
            body = {"version": pointer["version"], "epoch": epoch}
            if self._w.compare_and_swap(LATEST, dumps(body), current[1]):
                return

    # ------------------------------------------------------------------ publish
    # ------------------------------------------------------------------ publish

    def publish(
        self,
        version: int,
        tensors: dict[str, np.ndarray],
        *,
        split: dict[str, int | None] | None = None,
        parts: int = 1,
        **options: Any,
    ) -> bool:
        """``publish_snapshot`` of ``Snapshot.of(version, tensors, split, parts)``: the
        tensors cut into the pieces of the sampler's mesh (``split``: the axis of each tensor
        its ``parts`` tensor ranks split, ``tpu_jobs.model.mesh.split_axes``; absent or None:
        replicated). ``options``: ``epoch``, ``metadata``, ``base``, ``full``, ``full_every``."""
        _check_version(version)
        return self.publish_snapshot(Snapshot.of(version, tensors, split, parts), **options)

    def publish_snapshot(
        self,
        snapshot: Snapshot,
        *,
        epoch: int,
        metadata: dict[str, Any] | None = None,
        base: Snapshot | None = None,
        full: bool = True,
        full_every: int = 1,
    ) -> bool:
        """Commit ``snapshot`` (complete, as made by ``Snapshot.of``) as its version and move
        LATEST forward to it. A trainer keeps the snapshot as the ``base`` of its next delta.

        ``full``: store a full snapshot. ``base``: also store a delta against it (a complete
        snapshot of ``version - 1``, committed: its manifest gives this version's anchor);
        at least one of the two. ``full_every``: recorded for readers (how far back a held
        version is still worth rebuilding from).

        Returns False (writing nothing) if the version is already committed (a retry); LATEST
        is still moved forward to it, so on return the version is committed and LATEST >= it.
        Raises StaleEpochError if a newer epoch exists, checked before writing, before the
        manifest and before moving LATEST (which is also fenced by CAS, see the package doc).
        """
        version = snapshot.version
        _check_version(version)
        if snapshot.ranks is not None:
            raise ValueError(f"v{version} holds some tensor ranks only; publish needs them all")
        if not full and base is None:
            raise ValueError("publish needs full=True or a base to store a delta against")
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        metadata = dict(metadata or {})
        dumps(metadata)  # fail early on metadata that is not JSON-serialisable
        if base is not None:
            writing.check_base(snapshot, base)

        self._check_epoch(epoch)
        existing = self._read_manifest_or_none(version)
        if existing is not None:
            return self._already_committed(version, existing, epoch)
        anchor = version if full else self._anchor_of(base.version)  # type: ignore[union-attr]

        attempt = uuid.uuid4().hex[:12]
        manifest = writing.new_manifest(
            snapshot,
            epoch=epoch,
            attempt=attempt,
            metadata=metadata,
            anchor=anchor,
            base=None if base is None else base.version,
            full_every=full_every,
        )
        groups = writing.groups_of(snapshot)
        written: list[str] = []
        sizes = {"shard_bytes": self.shard_bytes, "max_workers": self.max_workers}
        if full:
            manifest["full"] = writing.write_pieces(
                self._w, version, "full", attempt, snapshot.pieces, groups, written, **sizes
            )
        if base is not None:
            blobs = writing.delta_blobs(snapshot, base, self.max_workers)
            manifest["delta"] = {
                "codec": weight_codec.CODEC,
                **writing.write_pieces(
                    self._w, version, "delta", attempt, blobs, groups, written, **sizes
                ),
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

    def _anchor_of(self, version: int) -> int:
        """The anchor (nearest full snapshot) of committed ``version``."""
        return int(normalize(self._read_manifest(version))["anchor"])

    def _write_manifest(self, version: int, manifest: dict[str, Any]) -> bool:
        """The commit point: create-only."""
        return self._w.write_new(manifest_key(version), dumps(manifest))

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
            current = self._w.read_versioned(LATEST)
            generation = None
            if current is not None:
                pointer = self._parse_latest(current[0])
                generation = current[1]
                if pointer["epoch"] > epoch:
                    raise StaleEpochError(
                        f"epoch {epoch} is stale: {self._w.url_of(LATEST)} was fenced by epoch "
                        f"{pointer['epoch']}; not moving it to version {version}"
                    )
                if pointer["version"] is not None and pointer["version"] >= version:
                    return
            body = {"version": version, "epoch": epoch, "updated": time.time()}
            if self._w.compare_and_swap(LATEST, dumps(body), generation):
                return

    # ------------------------------------------------------------------ read side

    def latest_version(self) -> int | None:
        try:
            return self._parse_latest(self._w.read(LATEST))["version"]
        except ObjectNotFound:
            return None

    def versions(self) -> list[int]:
        """Committed versions (those with a manifest), ascending."""
        found = []
        for key in self._w.list("v"):
            m = MANIFEST_RE.match(key)
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
        this host holds (``tpu_jobs.model.mesh.tensor_ranks``; None: all): only their pieces and
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
        manifest = read_normalized(self._w, version)
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
        return rebuild(
            self._w,
            version,
            manifest,
            have,
            want,
            max_workers=self.max_workers,
            range_bytes=self.range_bytes,
            buffers=self._buffers,
        )

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
                    f"LATEST at {self._w.url_of(LATEST)} is {latest}, still below "
                    f"{min_version} after {timeout}s"
                )
            remaining = math.inf if deadline is None else deadline - time.monotonic()
            time.sleep(max(0.0, min(poll, remaining)))

    # ------------------------------------------------------------------ healing

    def report_refused(self, version: int, reader: str, reason: str) -> None:
        """A reader (a rollout worker) could not use ``version`` (missing or failing
        verification): leave a damage report the trainer acts on (`refused`, `repair`).
        Create-only, one per reader and version: a reader that fails again while its report
        is pending writes nothing new."""
        record = {"version": version, "reader": reader, "reason": reason, "time": time.time()}
        self._w.write_new(self._report_key(version, reader), dumps(record))

    def report_pending(self, version: int, reader: str) -> bool:
        """Whether ``reader``'s damage report of ``version`` is still there (the trainer
        deletes it once it has repaired the version): a cheap check a waiting reader polls
        instead of pulling the version again."""
        return self._w.exists(self._report_key(version, reader))

    @staticmethod
    def _report_key(version: int, reader: str) -> str:
        return f"{REFUSED}/{version_dir(version)}-{safe_name(reader, 'reader')[:100]}.json"

    def refused(self) -> dict[int, list[str]]:
        """{version: [reasons]} of the damage reports."""
        out: dict[int, list[str]] = {}
        for key in self._w.list(f"{REFUSED}/"):
            try:
                record = json.loads(self._w.read(key))
                out.setdefault(int(record["version"]), []).append(str(record["reason"]))
            except (ObjectNotFound, ValueError, KeyError, TypeError):
                continue
        return out

    def clear_reports(self, version: int) -> None:
        """Delete the damage reports of ``version`` (repaired, or no longer needed)."""
        for key in self._w.list(f"{REFUSED}/{version_dir(version)}-"):
            self._w.delete(key)

    def damage(self, version: int) -> str | None:
        """Why ``version`` cannot be pulled (rebuilt from its anchor and verified), or None
        if it can."""
        try:
            self.pull(version)
        except (CorruptSnapshotError, SnapshotNotFoundError) as err:
            return str(err)
        return None

    def derive(self, version: int) -> Snapshot | None:
        """``version``'s exact tensors from the store by any intact chain, or None.

        ``pull`` follows one chain (the anchor's full snapshot and the deltas after it). A
        version stored with a delta has another: the newest older version that still pulls,
        then each delta up to ``version`` (a full snapshot at multiples of ``full_every``
        also holds a delta against the version before, so its full objects can be rebuilt
        from the previous anchor's). Every piece is verified against the CRC-32C its
        manifest recorded when the version was published, so what comes back has the bits
        the trainer published."""
        try:
            return self.pull(version)
        except (CorruptSnapshotError, SnapshotNotFoundError):
            pass
        committed = [v for v in self.versions() if v < version]
        for start in reversed(committed):
            try:
                held = self.pull(start)
                for v in range(start + 1, version + 1):  # each delta, no other fallback
                    held = self._rebuild(v, read_normalized(self._w, v), held, None)
            except (CorruptSnapshotError, SnapshotNotFoundError):
                continue
            return held
        return None

    def repair(
        self,
        snapshot: Snapshot,
        *,
        epoch: int,
        base: Snapshot | None = None,
        metadata: dict[str, Any] | None = None,
        full_every: int = 1,
    ) -> str:
        """Republish ``snapshot``'s version from it: tensors with the very bits the version
        was published with (the trainer's parameters of that version, its checkpoint, or
        ``derive``), as a full snapshot, plus a delta against ``base`` (the previous
        version, complete) when given, so that chains of later versions through this one
        stay intact. Returns the URL of the quarantine prefix the replaced objects went to.

        Committed objects are never overwritten: the damaged ones (manifest first, so no
        reader ever sees a mix of old and new shards) are copied create-only to
        ``quarantine/v{version:08d}-{stamp}/`` and then deleted; the new ones are written
        create-only under a new attempt id and committed by a create-only manifest, as any
        publish. The version's damage reports are deleted last."""
        version = snapshot.version
        self._check_epoch(epoch)
        moved = f"{QUARANTINE}/{version_dir(version)}-{time.strftime('%Y%m%dT%H%M%S')}"
        moved += f"-{uuid.uuid4().hex[:6]}"
        keys = self._w.list(f"{version_dir(version)}/")
        first = [k for k in keys if k == manifest_key(version)]
        for key in first + [k for k in keys if k not in first]:
            try:
                self._w.write_new(f"{moved}/{key.split('/', 1)[1]}", self._w.read(key))
            except ObjectNotFound:
                continue  # deleted meanwhile (a concurrent retention)
            self._w.delete(key)
        self.publish_snapshot(
            snapshot,
            epoch=epoch,
            metadata=metadata,
            base=base,
            full=True,
            full_every=full_every,
        )
        self.clear_reports(version)
        return self._w.url_of(moved)

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
            m = VERSION_DIR_RE.match(key)
            if m:
                by_version.setdefault(int(m.group(1)), []).append(key)
        committed = sorted(v for v, ks in by_version.items() if manifest_key(v) in ks)
        latest = self.latest_version()
        keep = set(committed[max(0, len(committed) - keep_last) :] if keep_last else [])
        keep |= set(protected)
        if latest is not None:
            keep.add(latest)
        # A kept version needs its links: its anchor's full snapshot and the deltas after it.
        for v in sorted(keep & set(committed)):
            try:
                anchor = int(normalize(self._read_manifest(v))["anchor"])
            except (SnapshotNotFoundError, CorruptSnapshotError, KeyError, TypeError, ValueError):
                continue  # unreadable: nothing to follow (a reader refuses it anyway)
            keep |= {u for u in committed if anchor <= u < v}
        doomed = [v for v in committed if v not in keep]
        for v in doomed:
            self._w.delete(manifest_key(v))
            for key in by_version[v]:
                if key != manifest_key(v):
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
                manifest = normalize(self._read_manifest(v))
                referenced = {
                    s["key"]
                    for kind in ("full", "delta")
                    for s in manifest.get(kind, {}).get("shards", [])
                }
            except (SnapshotNotFoundError, CorruptSnapshotError, KeyError, TypeError):
                continue
            for key in by_version[v]:
                if key != manifest_key(v) and key not in referenced:
                    self._w.delete(key)
        return doomed

    # ------------------------------------------------------------------ parsing

    def _read_manifest_or_none(self, version: int) -> dict[str, Any] | None:
        try:
            return self._read_manifest(version)
        except SnapshotNotFoundError:
            return None

    def _read_normalized(self, version: int) -> dict[str, Any]:
        return read_normalized(self._w, version)

    def _read_manifest(self, version: int) -> dict[str, Any]:
        return read_manifest(self._w, version)

    def _parse_epoch(self, raw: bytes) -> int:
        return parse_epoch(self._w, raw)

    def _parse_latest(self, raw: bytes) -> dict[str, Any]:
        return parse_latest(self._w, raw)


def _check_version(version: Any) -> None:
    if not isinstance(version, int) or isinstance(version, bool):
        raise TypeError(f"version must be an int, got {version!r}")
    if not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version must be in [0, {MAX_VERSION}], got {version}")
