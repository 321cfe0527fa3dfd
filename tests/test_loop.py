"""benchmarks/loop.py's measurement: busy-interval unions and idle shares against
hand-computed values."""

import json
import os

import pytest

from benchmarks.loop import Setting, busy_seconds, grid, measure, rollout_records
from pipeline.run import Run
from tests.runs import tiny_config


def test_busy_seconds_counts_overlaps_once_and_clips_to_the_window():
    # [0, 4] and [2, 6] overlap on [2, 4]: union [0, 6]; [8, 9] apart; [9, 9.5] touches it.
    intervals = [(2.0, 6.0), (0.0, 4.0), (8.0, 9.0), (9.0, 9.5)]
    assert busy_seconds(intervals, 0.0, 10.0) == pytest.approx(6.0 + 1.5)
    # Window [3, 8.5]: [3, 6] and [8, 8.5].
    assert busy_seconds(intervals, 3.0, 8.5) == pytest.approx(3.0 + 0.5)
    # An interval inside another adds nothing; ones outside the window add nothing.
    assert busy_seconds([(1.0, 5.0), (2.0, 3.0), (-4.0, -1.0), (11.0, 12.0)], 0, 10) == 4.0
    assert busy_seconds([], 0.0, 10.0) == 0.0


def test_measure_uses_the_window_after_the_warmup_steps():
    # Steps end at t = 10, 12, 15, 20; step 1 took 4 s (3 of them waiting).
    train = [
        {"step": 3, "time": 15.0, "wait_s": 1.0, "step_s": 3.0, "batch_index": 2},
        {"step": 1, "time": 10.0, "wait_s": 3.0, "step_s": 4.0, "batch_index": 0},
        {"step": 4, "time": 20.0, "wait_s": 2.0, "step_s": 5.0, "batch_index": 3},
        {"step": 2, "time": 12.0, "wait_s": 0.5, "step_s": 2.0, "batch_index": 1},
    ]

    def batch(index, worker, end, seconds, tokens, committed=True):
        return {
            "batch_index": index,
            "worker_id": worker,
            "end": end,
            "seconds": seconds,
            "tokens": tokens,
            "committed": committed,
        }

    rollouts = [
        batch(0, "worker0", 7.0, 5.0, 100),
        batch(1, "worker1", 11.0, 6.0, 200),
        batch(2, "worker0", 14.0, 4.0, 300),  # [10, 14]
        batch(3, "worker1", 17.0, 6.0, 400),  # [11, 17]
        batch(3, "worker0", 18.0, 3.0, 999, committed=False),  # [15, 18], made twice
    ]
    got = measure(train, rollouts, ["worker0", "worker1"], warmup=2)
    # Window: end of step 2 (12) to end of step 4 (20), steps 3 and 4.
    assert got["window_s"] == 8.0 and got["window_steps"] == 2
    assert got["tokens"] == 300 + 400 and got["tokens_per_s"] == pytest.approx(700 / 8)
    assert got["trainer_idle"] == pytest.approx((1.0 + 2.0) / 8)
    # worker0 busy in [12, 20]: [12, 14] and [15, 18] = 5 s; worker1: [12, 17] = 5 s.
    assert got["worker_idle"] == pytest.approx({"worker0": 3 / 8, "worker1": 3 / 8})
    assert got["made_twice"] == 1

    # No warmup: the window starts when step 1 began (10 - 4 = 6), ends at 20.
    whole = measure(train, rollouts, ["worker0", "worker1"], warmup=0)
    assert whole["window_s"] == 14.0 and whole["tokens"] == 1000
    assert whole["trainer_idle"] == pytest.approx(6.5 / 14)
    # worker0: [6, 7] + [10, 14] + [15, 18] = 8 s; worker1: [6, 11] + [11, 17] = 11 s.
    assert whole["worker_idle"] == pytest.approx({"worker0": 6 / 14, "worker1": 3 / 14})

    with pytest.raises(ValueError, match="warmup"):
        measure(train, rollouts, ["worker0"], warmup=4)


def test_grid_and_overrides():
    settings = grid([1, 2], [0], [1, 4], [1])
    # max_staleness outermost (a cut run has whole staleness values), workers innermost.
    want = ["w1-s0-p1-i1", "w2-s0-p1-i1", "w1-s0-p4-i1", "w2-s0-p4-i1"]
    assert [s.name() for s in settings] == want
    assert Setting(2, 1, 4, 2).overrides(16) == [
        "workers=2",
        "trainer.max_staleness=1",
        "trainer.publish_every=4",
        "rollout.inflight_batches=2",
        "trainer.steps=16",
    ]


def test_rollout_records_end_at_their_time_or_their_file_mtime(tmp_path):
    run = Run.create(str(tmp_path / "run"), tiny_config())
    run.store.write_new("metrics/rollout/b00000000-a.json", json.dumps({"seconds": 1}).encode())
    run.store.write_new("metrics/rollout/b00000001-b.json", json.dumps({"time": 5.0}).encode())
    os.utime(tmp_path / "run/metrics/rollout/b00000000-a.json", (100.0, 123.5))
    assert [r["end"] for r in rollout_records(run)] == [123.5, 5.0]
