"""BatchLeases: exclusive claims on rollout batch indices, on both backends."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pipeline.leases import BatchLeases, Lease, LeaseLostError
from pipeline.paramserver import ParamServer
from pipeline.storage import ObjectStore
from tests.clock import FakeClock

TTL = 30.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def leases(store: ObjectStore, clock: FakeClock) -> BatchLeases:
    return BatchLeases(store.child("run"), ttl_seconds=TTL, clock=clock)


def test_claim_is_exclusive_while_live(leases: BatchLeases, clock: FakeClock) -> None:
    a = leases.claim(0, "worker-a", version=3)
    assert isinstance(a, Lease)
    assert (a.index, a.worker_id, a.version, a.expires_at) == (0, "worker-a", 3, clock.now + TTL)
    assert leases.claim(0, "worker-b", version=3) is None
    assert leases.claim(0, "worker-a", version=3) is None  # even the holder cannot double-claim
    clock.advance(TTL - 1)
    assert leases.claim(0, "worker-b", version=3) is None
    clock.advance(2)  # now expired
    b = leases.claim(0, "worker-b", version=4)
    assert b is not None and b.worker_id == "worker-b"
    with pytest.raises(LeaseLostError, match="held by worker-b"):
        leases.renew(a)
    assert not leases.release(a)  # a stale holder cannot drop the new holder's lease
    assert leases.claim(0, "worker-c", version=4) is None


def test_renew_extends_and_release_frees(leases: BatchLeases, clock: FakeClock) -> None:
    lease = leases.claim(7, "w", version=1)
    clock.advance(TTL - 1)
    renewed = leases.renew(lease, version=2)
    assert renewed.expires_at == clock.now + TTL and renewed.version == 2
    clock.advance(TTL - 1)  # past the original expiry, within the renewed one
    assert leases.claim(7, "other", version=2) is None
    assert [x.index for x in leases.live_leases()] == [7]
    assert leases.live_leases()[0].version == 2
    assert leases.release(renewed)
    assert leases.live_leases() == []
    taken = leases.claim(7, "other", version=2)  # claimable at once, no TTL wait
    assert taken is not None
    with pytest.raises(LeaseLostError):
        leases.renew(renewed)


def test_claim_next_skips_committed_and_live_leases(leases: BatchLeases, clock: FakeClock) -> None:
    assert leases.commit_batch(0, b"batch-0")
    assert leases.commit_batch(2, b"batch-2")
    held = leases.claim(1, "a", version=1)
    assert held is not None
    assert leases.claim(2, "a", version=1) is None  # committed batches are not claimable
    first = leases.claim_next(0, "b", version=1)
    assert first.index == 3
    second = leases.claim_next(0, "c", version=1)
    assert second.index == 4
    assert leases.claim_next(0, "d", version=1, limit=5) is None  # 0..4 all taken
    assert leases.claim_next(3, "d", version=1).index == 5
    leases.release(held)
    assert leases.claim_next(0, "d", version=1, limit=5).index == 1
    clock.advance(TTL + 1)  # every lease expired: the lowest uncommitted index comes back
    assert leases.claim_next(0, "e", version=2).index == 1


def test_expired_lease_taken_over_by_exactly_one_of_8_workers(
    leases: BatchLeases, clock: FakeClock
) -> None:
    assert leases.claim(5, "crashed-worker", version=1) is not None
    clock.advance(TTL + 1)
    barrier = threading.Barrier(8)
    results: list[Lease | None] = [None] * 8
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = leases.claim(5, f"worker-{i}", version=2)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    live = leases.live_leases()
    assert [(x.worker_id, x.claim_id) for x in live] == [
        (winners[0].worker_id, winners[0].claim_id)
    ]


def test_claim_next_race_gives_distinct_indices(leases: BatchLeases) -> None:
    barrier = threading.Barrier(6)
    got: list[int] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        barrier.wait()
        lease = leases.claim_next(0, f"w{i}", version=1)
        with lock:
            got.append(lease.index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(got) == list(range(6))


def test_commit_batch_is_create_only(leases: BatchLeases) -> None:
    lease = leases.claim(3, "a", version=1)
    assert leases.commit_batch(3, b"first")
    assert not leases.commit_batch(3, b"second")  # a slow duplicate worker loses
    assert leases.read_batch(3) == b"first"
    assert leases.batch_exists(3) and not leases.batch_exists(4)
    assert leases.committed_indices() == [3]
    assert leases.live_leases() == []  # a lease on a committed batch protects nothing
    assert leases.release(lease)
    assert leases.claim(3, "b", version=1) is None
    assert leases.store.list("rollouts/") == [
        "rollouts/b00000003.lease",
        "rollouts/b00000003.parquet",
    ]


def test_gc_never_deletes_versions_of_live_leases_nor_latest(
    store: ObjectStore, clock: FakeClock
) -> None:
    run = store.child("run")
    ps = ParamServer(run, shard_bytes=1024)
    leases = BatchLeases(run, ttl_seconds=TTL, clock=clock)
    epoch = ps.acquire_epoch()
    weights = {v: {"w": np.full(300, v, dtype=np.float32)} for v in range(1, 7)}
    for v in range(1, 6):
        ps.publish(v, weights[v], epoch=epoch)
    old = leases.claim(10, "slow-worker", version=2)
    expired = leases.claim(11, "dead-worker", version=3)
    clock.advance(TTL - 5)
    leases.renew(old)  # still working on version 2
    clock.advance(10)  # 'expired' is now past its TTL
    assert expired is not None
    protected = {lease.version for lease in leases.live_leases()}
    assert protected == {2}
    assert ps.gc(keep_last=1, protected=protected) == [1, 3, 4]
    assert ps.versions() == [2, 5]
    assert ps.latest_version() == 5
    np.testing.assert_array_equal(ps.pull(2).tensors["w"], weights[2]["w"])
    np.testing.assert_array_equal(ps.pull().tensors["w"], weights[5]["w"])
    # keep_last=0 still keeps LATEST (and the lease's version).
    assert ps.gc(keep_last=0, protected=protected) == []
    ps.publish(6, weights[6], epoch=epoch)
    assert ps.gc(keep_last=0, protected=set()) == [2, 5]
    assert ps.versions() == [6]
