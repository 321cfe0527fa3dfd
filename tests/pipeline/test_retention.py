"""Retention of weight versions: never deletes what a reader uses, on both backends."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from pipeline.leases import BatchLeases
from pipeline.paramserver import (
    CorruptSnapshotError,
    ParamServer,
    SnapshotNotFoundError,
    StaleEpochError,
)
from pipeline.retention import apply_retention, lease_versions, pending_versions
from pipeline.rollouts import required_version
from pipeline.storage import ObjectStore
from tests.clock import FakeClock

TTL = 30.0


class HookedStore(ObjectStore):
    """Delegates to ``inner``; calls ``on_read(full_key)`` before each read (to interleave)."""

    def __init__(self, inner: ObjectStore, on_read: Callable[[str], None], path: str = "") -> None:
        self.inner, self.on_read, self.path = inner, on_read, path

    @property
    def url(self) -> str:
        return self.inner.url

    def child(self, prefix: str) -> HookedStore:
        path = f"{self.path}/{prefix}" if self.path else prefix
        return HookedStore(self.inner.child(prefix), self.on_read, path)

    def _full(self, key: str) -> str:
        return f"{self.path}/{key}" if self.path else key

    def read(self, key: str) -> bytes:
        self.on_read(self._full(key))
        return self.inner.read(key)

    def read_to_file(self, key: str, local_path: str | os.PathLike[str]) -> None:
        self.on_read(self._full(key))
        self.inner.read_to_file(key, local_path)

    def write_new(self, key: str, data: bytes) -> bool:
        return self.inner.write_new(key, data)

    def write_new_file(self, key: str, local_path: str | os.PathLike[str]) -> bool:
        return self.inner.write_new_file(key, local_path)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        return self.inner.read_versioned(key)

    def compare_and_swap(self, key: str, data: bytes, expected_generation: int | None) -> bool:
        return self.inner.compare_and_swap(key, data, expected_generation)


def _weights(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {
        "a": rng.standard_normal((20, 30)).astype(np.float32),  # 2400 B: a shard of its own
        "b": np.full((7,), version, dtype=np.int64),
        "c": rng.standard_normal((50,)).astype(np.float32),
    }


def _assert_weights(snapshot, version: int) -> None:
    expected = _weights(version)
    assert sorted(snapshot.tensors) == sorted(expected)
    for name, arr in expected.items():
        assert snapshot.tensors[name].tobytes() == arr.tobytes(), (version, name)


# --------------------------------------------------------------------------- the window


@pytest.mark.parametrize(
    ("next_batch", "publish_every", "max_staleness", "expected"),
    [
        (0, 1, 0, {0, 1}),  # indices 0..1 -> versions 0, 1
        (5, 1, 1, {4, 5, 6}),  # indices 5..7 -> 4, 5, 6
        (4, 2, 1, {1, 2, 3}),  # indices 4..8 -> 4//2-1=1 .. 8//2-1=3
        (3, 3, 0, {1, 2}),  # indices 3..6 -> 1, 2
        (0, 2, 2, {0, 1}),  # indices 0..6 -> clamped to 0 up to 6//2-2 = 1
    ],
)
def test_pending_versions_hand_computed(next_batch, publish_every, max_staleness, expected):
    assert pending_versions(next_batch, publish_every, max_staleness) == expected


@pytest.mark.parametrize("publish_every", [1, 2, 3])
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_window_covers_every_index_a_worker_may_claim(publish_every, max_staleness):
    """Re-derive the worker's claim range (tpu_jobs.rollout_worker) and check coverage.

    After the trainer's step ``step`` (``dropped`` batches skipped), LATEST is at most
    ``step // publish_every`` and every index below ``next_batch`` is committed; a worker
    claims an uncommitted index below ``(latest + max_staleness + 1) * publish_every``.
    """
    for step in range(12):
        for dropped in range(3):
            next_batch = step + dropped
            window = pending_versions(next_batch, publish_every, max_staleness)
            for latest in range(step // publish_every + 1):
                limit = (latest + max_staleness + 1) * publish_every
                for index in range(next_batch, limit):
                    v = required_version(index, publish_every, max_staleness)
                    assert v in window, (step, dropped, latest, index, v, window)


def test_pending_versions_rejects_bad_arguments():
    with pytest.raises(ValueError, match="publish_every"):
        pending_versions(0, 0, 1)
    with pytest.raises(ValueError, match="max_staleness"):
        pending_versions(0, 1, -1)
    with pytest.raises(ValueError, match="next_batch"):
        pending_versions(-1, 1, 0)


# --------------------------------------------------------------------------- deletion


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _publish_all(ps: ParamServer, versions: range) -> int:
    epoch = ps.acquire_epoch()
    for v in versions:
        ps.publish(v, _weights(v), epoch=epoch)
    return epoch


def test_retention_never_deletes_a_leased_version(store: ObjectStore, clock: FakeClock) -> None:
    run = store.child("run")
    ps = ParamServer(run, shard_bytes=1024)
    leases = BatchLeases(run, ttl_seconds=TTL, clock=clock)
    epoch = _publish_all(ps, range(10))
    slow = leases.claim(30, "slow-worker", version=2)  # a worker far behind, still working
    dead = leases.claim(31, "dead-worker", version=3)
    done = leases.claim(32, "done-worker", version=4)
    assert slow and dead and done and leases.commit_batch(32, b"batch")  # committed: no claim
    clock.advance(TTL - 1)
    leases.renew(slow)
    clock.advance(2)  # 'dead' expired; 'slow' renewed
    result = apply_retention(
        ps, leases, keep_last=2, next_batch=8, publish_every=1, max_staleness=1, epoch=epoch
    )
    # kept: newest two (8, 9), leased (2), pending indices 8..10 -> versions 7, 8, 9
    assert result.kept == ps.versions() == [2, 7, 8, 9]
    assert result.deleted == [0, 1, 3, 4, 5, 6]
    assert result.protected == {"pending": [7, 8, 9], "leases": [2]}
    _assert_weights(ps.pull(2), 2)
    _assert_weights(ps.pull(), 9)
    for v in result.deleted:
        with pytest.raises(SnapshotNotFoundError):
            ps.pull(v)
    # Nothing of a deleted version is left behind.
    assert not [k for k in run.list("weights/") if k.startswith("weights/v00000003/")]
    # Once the slow worker commits, its version is no longer protected.
    assert leases.commit_batch(30, b"batch")
    result = apply_retention(
        ps, leases, keep_last=2, next_batch=8, publish_every=1, max_staleness=1, epoch=epoch
    )
    assert result.deleted == [2] and result.kept == [7, 8, 9]


def test_clock_skew_keeps_recently_expired_leases(store: ObjectStore, clock: FakeClock) -> None:
    run = store.child("run")
    ps = ParamServer(run, shard_bytes=1024)
    leases = BatchLeases(run, ttl_seconds=TTL, clock=clock)
    _publish_all(ps, range(6))
    assert leases.claim(20, "w-behind", version=1)
    clock.advance(TTL + 5)  # expired 5 s ago by our clock; its host's clock may be behind
    assert lease_versions(leases) == set()
    assert lease_versions(leases, clock_skew_s=10) == {1}
    result = apply_retention(
        ps, leases, keep_last=1, next_batch=5, publish_every=1, max_staleness=0, clock_skew_s=10
    )
    assert result.kept == [1, 5]


def test_stale_trainer_may_not_run_retention(store: ObjectStore, clock: FakeClock) -> None:
    run = store.child("run")
    ps = ParamServer(run, shard_bytes=1024)
    leases = BatchLeases(run, ttl_seconds=TTL, clock=clock)
    old_epoch = _publish_all(ps, range(5))
    ps.acquire_epoch()  # a new trainer took over
    with pytest.raises(StaleEpochError, match="stale"):
        apply_retention(
            ps, leases, keep_last=1, next_batch=4, publish_every=1, max_staleness=0, epoch=old_epoch
        )
    assert ps.versions() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        apply_retention(ps, leases, keep_last=0, next_batch=4, publish_every=1, max_staleness=0)


def test_a_pulled_snapshot_outlives_the_deletion_of_its_version(
    store: ObjectStore, clock: FakeClock
) -> None:
    """What a reader already holds stays intact (local pulls map the shard files)."""
    run = store.child("run")
    ps = ParamServer(run, shard_bytes=1024)
    leases = BatchLeases(run, ttl_seconds=TTL, clock=clock)
    _publish_all(ps, range(5))
    held = ps.pull(1)
    result = apply_retention(
        ps, leases, keep_last=1, next_batch=4, publish_every=1, max_staleness=0
    )
    assert 1 in result.deleted and not run.list("weights/v00000001/")
    _assert_weights(held, 1)


# --------------------------------------------------------------------------- concurrent readers


def test_gc_in_the_middle_of_a_pull(store: ObjectStore, clock: FakeClock) -> None:
    """Retention runs between a reader's manifest read and its shard reads (deterministic).

    The leased version's pull completes with the right bytes; an unprotected version's pull
    fails cleanly (missing shard or manifest), never with wrong data.
    """
    run = store.child("run")
    # (version whose first shard read triggers retention, the trainer's next batch then)
    gc_now: list[tuple[int, int]] = []
    triggered: list[int] = []

    def on_read(key: str) -> None:
        if gc_now and key.startswith(f"weights/v{gc_now[0][0]:08d}/full-"):
            version, next_batch = gc_now.pop()
            triggered.append(version)
            apply_retention(
                ps_plain,
                leases,
                keep_last=1,
                next_batch=next_batch,
                publish_every=1,
                max_staleness=0,
            )

    ps_plain = ParamServer(run, shard_bytes=1024)
    leases = BatchLeases(run, ttl_seconds=TTL, clock=clock)
    reader = ParamServer(HookedStore(run, on_read), shard_bytes=1024)
    _publish_all(ps_plain, range(10))
    assert leases.claim(40, "w", version=3)

    gc_now.append((3, 5))  # keeps 3 (leased), 5 and 6 (pending) and 9 (newest)
    _assert_weights(reader.pull(3), 3)
    assert triggered == [3] and ps_plain.versions() == [3, 5, 6, 9]

    gc_now.append((5, 9))  # 5 is no longer pending, nor leased, nor among the newest
    with pytest.raises(CorruptSnapshotError, match="v5: shard .* is missing"):
        reader.pull(5)
    assert triggered == [3, 5] and ps_plain.versions() == [3, 9]


@pytest.mark.parametrize("publish_every", [1, 2])
def test_workers_pulling_while_the_trainer_collects(store: ObjectStore, publish_every) -> None:
    """The real protocol with threads: a trainer publishes and runs retention (keep_last=1)
    after every publish while workers claim, pull their pinned version and commit; a slow
    reader holds a lease and keeps re-pulling its version. No pull of a protected version
    may fail or return wrong bytes, and old versions do get deleted meanwhile."""
    run = store.child("run")
    max_staleness, steps, workers = 1, 12, 3
    ps = ParamServer(run, shard_bytes=1024)
    leases = BatchLeases(run, ttl_seconds=TTL)  # real clock
    errors: list[BaseException] = []
    pulls = {"worker": 0, "slow": 0}
    deleted: list[int] = []
    stop = threading.Event()

    def trainer() -> None:
        epoch = ps.acquire_epoch()
        ps.publish(0, _weights(0), epoch=epoch)
        for step in range(1, steps + 1):
            index = step - 1
            while not leases.batch_exists(index):
                if stop.is_set():
                    return
                time.sleep(0.001)
            if step % publish_every == 0:
                version = step // publish_every
                ps.publish(version, _weights(version), epoch=epoch)
                result = apply_retention(
                    ps,
                    leases,
                    keep_last=1,
                    next_batch=step,
                    publish_every=publish_every,
                    max_staleness=max_staleness,
                    epoch=epoch,
                )
                deleted.extend(result.deleted)

    def worker(name: str) -> None:
        while not stop.is_set():
            latest = ps.latest_version()
            if latest is None:
                time.sleep(0.001)
                continue
            limit = min(steps, (latest + max_staleness + 1) * publish_every)
            lease = leases.claim_next(0, name, latest, limit=limit)
            if lease is None:
                if leases.batch_exists(steps - 1):
                    return
                time.sleep(0.002)
                continue
            version = required_version(lease.index, publish_every, max_staleness)
            time.sleep(0.001)  # widen the claim-to-renew window that only the pending rule covers
            lease = leases.renew(lease, version=version)
            _assert_weights(ps.pull(version), version)
            pulls["worker"] += 1
            leases.commit_batch(lease.index, f"batch {lease.index}".encode())
            leases.release(lease)

    # Claimed before anything is published, so it protects version 0 from the start.
    assert leases.claim(10_000, "slow", version=0) is not None  # never committed

    def slow_reader() -> None:
        while ps.latest_version() is None and not stop.is_set():
            time.sleep(0.001)
        while not stop.is_set():
            _assert_weights(ps.pull(0), 0)
            pulls["slow"] += 1

    def guarded(fn, *args):
        def run_it() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                stop.set()

        return threading.Thread(target=run_it, daemon=True)

    threads = [guarded(trainer), guarded(slow_reader)]
    threads += [guarded(worker, f"w{i}") for i in range(workers)]
    for t in threads:
        t.start()
    threads[0].join(120)
    stop.set()
    for t in threads[1:]:
        t.join(60)
    assert not errors, errors
    assert leases.committed_indices() == list(range(steps))
    assert pulls["worker"] >= steps and pulls["slow"] >= 1
    final = steps // publish_every
    assert deleted and 0 not in deleted and final not in deleted
    assert set(ps.versions()) >= {0, final}
    assert len(ps.versions()) <= max_staleness + 4  # old versions really went away
