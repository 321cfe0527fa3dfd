"""Work distribution for rollout workers through ``rollouts/`` in object storage.

* ``b{index:08d}.parquet``: a committed rollout batch, create-only (first writer wins).
* ``quarantine/b{index:08d}-{n:03d}.parquet`` (+ ``.json``: the reason): a batch the trainer
  refused (`pipeline.batch_checks`), moved aside so that a worker produces it again.
* ``b{index:08d}.lease``: a worker's claim on an index: worker id, policy version, expiry and a
  unique claim id. Created create-only; an expired (or released) lease is taken over by CAS on
  its generation, so of any number of racing workers exactly one gets it. Renewal and release
  are CAS too and check the claim id, so a worker can never extend or drop someone else's
  lease.

Expiry uses the workers' clocks: keep ``ttl_seconds`` well above the clock skew between
machines. A lease only avoids duplicate work; correctness comes from the create-only batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from pipeline.layout import ROLLOUTS_PREFIX
from pipeline.storage import ObjectNotFound, ObjectStore

__all__ = ["BatchLeases", "Lease", "LeaseLostError"]

log = logging.getLogger(__name__)

_QUARANTINE = "quarantine"
_MAX_QUARANTINE = 1000  # the layout has 3 digits
_KEY_RE = re.compile(r"^b(\d{8})\.(parquet|lease)$")
_MAX_INDEX = 10**8 - 1  # the layout has 8 digits


class LeaseLostError(RuntimeError):
    """The lease is no longer ours (expired and taken over, released, or removed)."""


@dataclass(frozen=True)
class Lease:
    index: int
    worker_id: str
    version: int
    expires_at: float
    claim_id: str
    acquired_at: float
    released: bool = False

    def is_live(self, now: float) -> bool:
        return not self.released and now < self.expires_at

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Lease:
        d = json.loads(data)
        return cls(
            index=int(d["index"]),
            worker_id=str(d["worker_id"]),
            version=int(d["version"]),
            expires_at=float(d["expires_at"]),
            claim_id=str(d["claim_id"]),
            acquired_at=float(d["acquired_at"]),
            released=bool(d.get("released", False)),
        )


def batch_key(index: int) -> str:
    return f"b{index:08d}.parquet"


def lease_key(index: int) -> str:
    return f"b{index:08d}.lease"


def _check_index(index: int) -> int:
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= _MAX_INDEX:
        raise ValueError(f"batch index must be an int in [0, {_MAX_INDEX}], got {index!r}")
    return index


class BatchLeases:
    """Leases and committed batches under ``rollouts/`` of a run store."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        ttl_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive, got {ttl_seconds}")
        self.store = store
        self._r = store.child(ROLLOUTS_PREFIX)
        self.ttl_seconds = ttl_seconds
        self.clock = clock

    # ------------------------------------------------------------------ leases

    def claim(self, index: int, worker_id: str, version: int) -> Lease | None:
        """Claim batch ``index`` for ``worker_id`` sampling with policy ``version``.

        None if the batch is committed or someone else holds a live lease on it.
        """
        _check_index(index)
        if not worker_id:
            raise ValueError("worker_id must be a non-empty str")
        if self.batch_exists(index):
            return None
        key = lease_key(index)
        for _ in range(3):  # the lease object may vanish between our probes; retry a little
            lease = self._new_lease(index, worker_id, version)
            if self._r.write_new(key, lease.to_bytes()):
                return self._confirm(lease)
            current = self._r.read_versioned(key)
            if current is None:
                continue
            data, generation = current
            holder = self._decode(data, key)
            if holder is not None and holder.is_live(self.clock()):
                return None
            # Expired, released or unreadable: take over, but only from the exact generation
            # we inspected; of several racing workers exactly one CAS succeeds.
            lease = self._new_lease(index, worker_id, version)
            if self._r.compare_and_swap(key, lease.to_bytes(), generation):
                return self._confirm(lease)
            return None
        return None

    def claim_next(
        self, start: int, worker_id: str, version: int, limit: int | None = None
    ) -> Lease | None:
        """Claim the lowest index >= ``start`` (and < ``limit`` if given) that has neither a
        committed batch nor a live lease; None if there is none below ``limit``."""
        _check_index(start)
        committed, leased = self._scan()
        now = self.clock()
        index = start
        while limit is None or index < limit:
            if index > _MAX_INDEX:
                return None
            if index in committed:
                index += 1
                continue
            if index in leased:
                # Skip live leases with one read instead of a failed create plus a read.
                try:
                    holder = self._decode(self._r.read(lease_key(index)), lease_key(index))
                except ObjectNotFound:
                    holder = None
                if holder is not None and holder.is_live(now):
                    index += 1
                    continue
            lease = self.claim(index, worker_id, version)
            if lease is not None:
                return lease
            index += 1
        return None

    def renew(self, lease: Lease, version: int | None = None) -> Lease:
        """Extend our lease by ``ttl_seconds`` (optionally recording a newer policy version).

        Raises LeaseLostError if it is no longer ours.
        """
        key = lease_key(lease.index)
        current = self._r.read_versioned(key)
        if current is None:
            raise LeaseLostError(f"lease {self._r.url_of(key)} no longer exists")
        holder = self._decode(current[0], key)
        if holder is None or holder.claim_id != lease.claim_id or holder.released:
            who = "unreadable" if holder is None else f"held by {holder.worker_id}"
            raise LeaseLostError(f"lease {self._r.url_of(key)} is no longer ours ({who})")
        renewed = replace(
            holder,
            expires_at=self.clock() + self.ttl_seconds,
            version=holder.version if version is None else version,
        )
        if not self._r.compare_and_swap(key, renewed.to_bytes(), current[1]):
            raise LeaseLostError(f"lease {self._r.url_of(key)} changed while renewing")
        return renewed

    def release(self, lease: Lease) -> bool:
        """Give the lease up (marks it released, so it is claimable at once).

        False if it was no longer ours. Released by CAS rather than deleted, so a release can
        never remove a lease another worker took over meanwhile.
        """
        key = lease_key(lease.index)
        current = self._r.read_versioned(key)
        if current is None:
            return False
        holder = self._decode(current[0], key)
        if holder is None or holder.claim_id != lease.claim_id or holder.released:
            return False
        tombstone = replace(holder, released=True, expires_at=self.clock())
        return self._r.compare_and_swap(key, tombstone.to_bytes(), current[1])

    def live_leases(self) -> list[Lease]:
        """Live leases on uncommitted batches, by index (retention protects their versions)."""
        committed, leased = self._scan()
        now = self.clock()
        live = []
        for index in sorted(leased - committed):
            key = lease_key(index)
            try:
                holder = self._decode(self._r.read(key), key)
            except ObjectNotFound:
                continue
            if holder is not None and holder.is_live(now):
                live.append(holder)
        return live

    # ------------------------------------------------------------------ batches

    def commit_batch(self, index: int, data: bytes) -> bool:
        """Create ``b{index:08d}.parquet``; False if it already exists (first writer wins)."""
        return self._r.write_new(batch_key(_check_index(index)), data)

    def batch_exists(self, index: int) -> bool:
        return self._r.exists(batch_key(_check_index(index)))

    def read_batch(self, index: int) -> bytes:
        return self._r.read(batch_key(_check_index(index)))

    def committed_indices(self) -> list[int]:
        return sorted(self._scan()[0])

    # --------------------------------------------------------------- quarantine

    def quarantine(self, index: int, data: bytes, reason: str) -> str:
        """Move the committed batch ``index`` (its bytes ``data``) to ``quarantine/`` with
        ``reason``, so that a worker produces it again (batches are deterministic given
        their index and pinned version). Returns the quarantined object's key.

        The copy and its reason are written before the batch is deleted: a crash in between
        leaves the batch in place, and the retried check quarantines it again under the next
        number. Only the (fenced) trainer calls this, the one exception to create-only
        batches."""
        _check_index(index)
        for n in range(len(self.quarantined(index)), _MAX_QUARANTINE):
            stem = f"{_QUARANTINE}/b{index:08d}-{n:03d}"
            if self.store.write_new(f"{stem}.parquet", data):
                record = {"batch_index": index, "reason": reason, "time": self.clock()}
                self.store.write_new(f"{stem}.json", json.dumps(record, sort_keys=True).encode())
                with contextlib.suppress(ObjectNotFound):
                    self._r.delete(batch_key(index))
                return f"{stem}.parquet"
        raise RuntimeError(f"batch {index} was quarantined {_MAX_QUARANTINE} times")

    def quarantined(self, index: int | None = None) -> list[dict]:
        """The reasons recorded for quarantined batches (of ``index``, or all), oldest first."""
        prefix = f"{_QUARANTINE}/" + ("" if index is None else f"b{index:08d}-")
        out = []
        for key in self.store.list(prefix):
            if key.endswith(".json"):
                with contextlib.suppress(ObjectNotFound):
                    out.append({"key": key, **json.loads(self.store.read(key))})
        return out

    # ------------------------------------------------------------------ internals

    def _new_lease(self, index: int, worker_id: str, version: int) -> Lease:
        now = self.clock()
        return Lease(
            index=index,
            worker_id=worker_id,
            version=int(version),
            expires_at=now + self.ttl_seconds,
            claim_id=uuid.uuid4().hex,  # makes lease bytes unique: retried writes stay exact
            acquired_at=now,
        )

    def _confirm(self, lease: Lease) -> Lease | None:
        # The batch may have been committed between our first check and the claim.
        if self.batch_exists(lease.index):
            self.release(lease)
            return None
        return lease

    def _decode(self, data: bytes, key: str) -> Lease | None:
        try:
            return Lease.from_bytes(data)
        except (ValueError, KeyError, TypeError):
            log.warning(
                "unreadable lease %s treated as expired: %r", self._r.url_of(key), data[:100]
            )
            return None

    def _scan(self) -> tuple[set[int], set[int]]:
        committed: set[int] = set()
        leased: set[int] = set()
        for key in self._r.list("b"):
            m = _KEY_RE.match(key)
            if m:
                (committed if m.group(2) == "parquet" else leased).add(int(m.group(1)))
        return committed, leased
