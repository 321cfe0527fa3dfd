"""Retention of published weight versions: delete old snapshots, never one a reader needs.

The trainer calls ``apply_retention`` after each publish. A committed version survives if it is

* among the newest ``keep_last`` committed versions (LATEST is always among them);
* named by a live rollout lease (``BatchLeases.live_leases``): a worker is generating with it;
* *pending*: the pinned version (``pipeline.rollouts.required_version``) of a batch the trainer
  has not consumed yet and that a worker may claim now, i.e. indices ``next_batch`` through
  ``next_batch + (max_staleness + 1) * publish_every``.

Why that window is enough: every batch below ``next_batch`` is committed (the trainer consumed
it), so a worker only ever claims an index >= ``next_batch``; and a worker claims only below
``(latest + max_staleness + 1) * publish_every`` with ``latest <= next_batch // publish_every``
(``tpu_jobs.rollout_worker``). So the version any worker may pull is protected before it
claims, independently of when its lease object appears; the lease rule covers workers whose
view is older (a stale LATEST, a lease version recorded at claim time).

A kept version keeps its links too (``ParamServer.gc``): the full snapshot of its anchor and
the deltas from there to it, so it can be rebuilt by a reader that holds nothing.

Deletion itself is ``ParamServer.gc``: manifest first, so a version is either committed and
complete or not visible. A reader that raced the deletion of an *unprotected* version gets a
clean ``CorruptSnapshotError``/``SnapshotNotFoundError``, never wrong bytes (shards are
crc32c-checked).

Lease expiry is judged with this process's clock; ``clock_skew_s`` widens "live" by that much
so a lease on a machine whose clock runs behind is still honoured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.leases import BatchLeases
from pipeline.paramserver import ParamServer, StaleEpochError
from pipeline.rollouts import required_version

__all__ = [
    "RetentionResult",
    "apply_retention",
    "lease_versions",
    "pending_versions",
]


@dataclass(frozen=True)
class RetentionResult:
    """What one retention pass did. ``protected`` maps each reason to the versions it kept."""

    deleted: list[int]
    kept: list[int]
    protected: dict[str, list[int]] = field(default_factory=dict)


def pending_versions(next_batch: int, publish_every: int, max_staleness: int) -> set[int]:
    """Pinned versions of the batches workers may be producing for the trainer now.

    Indices ``next_batch`` .. ``next_batch + (max_staleness + 1) * publish_every`` (inclusive:
    one index more than a worker can claim, so an off-by-one elsewhere never costs a version).
    """
    if next_batch < 0:
        raise ValueError(f"next_batch must be >= 0, got {next_batch}")
    if publish_every < 1:
        raise ValueError(f"publish_every must be >= 1, got {publish_every}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    last = next_batch + (max_staleness + 1) * publish_every
    # required_version is monotone in the index: the window's versions are a range.
    low = required_version(next_batch, publish_every, max_staleness)
    high = required_version(last, publish_every, max_staleness)
    return set(range(low, high + 1))


def lease_versions(leases: BatchLeases, clock_skew_s: float = 0.0) -> set[int]:
    """Versions named by live leases on uncommitted batches (live within ``clock_skew_s``)."""
    if clock_skew_s < 0:
        raise ValueError(f"clock_skew_s must be >= 0, got {clock_skew_s}")
    if clock_skew_s:
        clock: Callable[[], float] = leases.clock
        leases = BatchLeases(
            leases.store, ttl_seconds=leases.ttl_seconds, clock=lambda: clock() - clock_skew_s
        )
    return {lease.version for lease in leases.live_leases()}


def apply_retention(
    ps: ParamServer,
    leases: BatchLeases,
    *,
    keep_last: int,
    next_batch: int,
    publish_every: int,
    max_staleness: int,
    epoch: int | None = None,
    clock_skew_s: float = 0.0,
    extra_protected: set[int] | frozenset[int] = frozenset(),
) -> RetentionResult:
    """Delete every committed version that is not kept by one of the rules (module doc).

    ``keep_last`` >= 1. ``epoch``: the caller's trainer epoch; if a newer trainer owns the run,
    raise ``StaleEpochError`` and delete nothing (a fenced-off trainer must not garbage-collect
    under the one that replaced it). ``extra_protected``: more versions to keep (e.g. ones an
    evaluator has not scored yet).
    """
    if keep_last < 1:
        raise ValueError(
            f"keep_last must be >= 1 (LATEST is always kept), got {keep_last}; "
            "to keep every version, do not call retention"
        )
    if epoch is not None:
        current = ps.current_epoch()
        if current > epoch:
            raise StaleEpochError(
                f"epoch {epoch} is stale (EPOCH is at {current}): not running retention"
            )
    # Leases and the pending window are read before listing versions: a version protected
    # now stays protected for this whole pass.
    protected = {
        "pending": pending_versions(next_batch, publish_every, max_staleness),
        "leases": lease_versions(leases, clock_skew_s),
        "extra": set(extra_protected),
    }
    keep = set().union(*protected.values())
    deleted = ps.gc(keep_last=keep_last, protected=keep)
    return RetentionResult(
        deleted=deleted,
        kept=ps.versions(),
        protected={reason: sorted(vs) for reason, vs in protected.items() if vs},
    )
