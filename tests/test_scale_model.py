"""benchmarks/scale_model.py: the cost model's arithmetic and the loop's simulation
against hand-computed values."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from benchmarks.scale_model import (
    MODES,
    Lengths,
    Loop,
    Roofline,
    Setting,
    evaluate,
    publish_seconds,
    pull_cost,
    simulate,
)


def test_the_seeds_setting_by_hand() -> None:
    s = Setting(delta_ratio=8.0, egress_quota_gbps=200.0, step_s=60.0)
    assert s.inference_hosts == 128  # (1024 - 512) chips / 4 per host
    assert s.host_fraction == 0.5  # TP 8 over 4-chip hosts
    f32, bf16, delta, shard = (evaluate(s, m) for m in MODES)
    assert f32["full_gb"] == 128.0 and bf16["full_gb"] == 64.0
    assert delta["version_gb"] == 8.0 and shard["host_gb"] == 4.0
    # 60 versions an hour x 128 hosts x 64 GB.
    assert bf16["egress_tb_per_h"] == pytest.approx(60 * 128 * 64 / 1000)
    # All hosts' bytes through 200 Gb/s = 25 GB/s: 128 x 64 GB / 25 GB/s.
    assert bf16["t_quota_s"] == pytest.approx(128 * 64 / 25)
    # One host: min(100 Gb/s, 8 x 150 MB/s) = 1.2 GB/s.
    assert shard["t_host_s"] == pytest.approx(4.0 / 1.2)
    assert bf16["first_to_break"].startswith("egress quota")
    assert shard["latest_writes_per_s"] == pytest.approx(1 / 60)
    assert Setting(step_s=0.5).step_s == 0.5
    assert evaluate(Setting(step_s=0.5, delta_ratio=1e6), MODES[3])["first_to_break"] == (
        "LATEST writes > 1/s"
    )


# The whole loop (benchmarks/scale_model.py's simulation): one replica of 8 chips, 4 rows
# per batch of constant length and no prompt, so every cost can be written down by hand.
# Deltas are a quarter of the 64 GB bf16 model, full snapshots never recur in the window.
ONE = Setting(chips=16, trainer_chips=8, sampler_tp=8, delta_ratio=4.0, full_every=1000)
HOST = 1.2e9  # one host's rate: min(100 Gb/s, 8 streams x 150 MB/s), bytes/s
PULL = 16e9 * 0.5 / HOST  # one delta; each of the replica's 2 hosts holds half of it
PUBLISH = 16e9 / HOST  # the trainer uploads one delta
WEIGHTS_S = 64e9 / (8 * 2765e9 * 0.8)  # a decode step reads the weights (bandwidth-bound)
KV_S = 2 * 64 * 8 * 128 * 2 / (8 * 2765e9 * 0.8)  # ... and each cached token's K and V


def loop(length: int, **kw: object) -> Loop:
    lengths = Lengths(mean=length, cap=100_000, sample=(length,))
    return Loop(
        ps=ONE, prompts_per_batch=2, group_size=2, prompt_tokens=0, lengths=lengths, steps=8,
        **kw,
    )  # fmt: skip


def generate(length: int, rows: int) -> float:
    """A batch of `rows` rows of `length` tokens: `length` steps, the context growing by
    `rows` a step from nothing (compute stays far below the bandwidth side here)."""
    return length * WEIGHTS_S + KV_S * rows * length * (length - 1) / 2


def train(length: int, rows: int = 4) -> float:
    return 6 * 32e9 * rows * length / (8 * 459e12 * 0.4)


def test_synchronous_step_is_pull_generate_train_publish() -> None:
    for length in (100, 10_000):
        r = simulate(loop(length))
        assert r["step_s"] == pytest.approx(PULL + generate(length, 4) + train(length) + PUBLISH)
        assert r["tokens_per_s"] == pytest.approx(4 * length / r["step_s"])
        assert r["slots"]["pulling"] > 0 and r["slots"]["waiting"] > 0


def test_staleness_one_overlaps_generation_with_training() -> None:
    # Long rows: the replica is the bottleneck, the trainer waits on it.
    long = simulate(loop(10_000, max_staleness=1))
    assert long["step_s"] == pytest.approx(PULL + generate(10_000, 4))
    assert long["trainer"]["idle"] > 0.5
    # Short rows: the trainer (its upload of each version) is, and it is never idle.
    short = simulate(loop(100, max_staleness=1))
    assert short["step_s"] == pytest.approx(train(100) + PUBLISH)
    assert short["trainer"]["idle"] == pytest.approx(0.0, abs=1e-9)
    assert short["limit"] == "trainer: publishing"


def test_inflight_batches_of_one_version_share_the_engine() -> None:
    # publish_every 2: batches 2v and 2v+1 are both pinned to version v.
    # One at a time: batch 2v+1 is generated while the trainer takes batch 2v.
    off = simulate(loop(1000, publish_every=2))
    period = PULL + 2 * generate(1000, 4) + train(1000) + PUBLISH
    assert off["step_s"] == pytest.approx(period / 2)
    # In flight: both batches' rows decode together and end together.
    same = simulate(loop(1000, publish_every=2, inflight="same version"))
    assert same["step_s"] == pytest.approx(
        (PULL + generate(1000, 8) + 2 * train(1000) + PUBLISH) / 2
    )
    # A version per step: past the first max_staleness + 1 batches (all pinned to v0), no
    # two batches share a version, so in-flight batches change nothing.
    assert simulate(loop(1000, max_staleness=1, inflight="same version")) == simulate(
        loop(1000, max_staleness=1)
    )


def test_roofline_sides_and_its_sum() -> None:
    lp = Loop()
    roof = Roofline.of(lp)
    assert roof.seconds(1, 1, 0) == pytest.approx(WEIGHTS_S)  # one row: read the weights
    # 4,096 rows with nothing cached: the matmuls' FLOPs at half of 8 chips' peak.
    assert roof.seconds(1, 4096, 0) == pytest.approx(2 * 32e9 * 4096 / (8 * 459e12 * 0.5))
    # The closed-form sum over a segment equals the step-by-step one across the crossing.
    by_step = sum(roof.seconds(1, 300, 300 * (1000 + k)) for k in range(5000))
    assert roof.seconds(5000, 300, 300 * 1000) == pytest.approx(by_step)
    # Two versions' weights: the any-version variant's steps read both.
    assert roof.seconds(1, 1, 0, copies=2) == pytest.approx(2 * WEIGHTS_S)
    assert lp.workers == 64 and lp.replica_slots == 71  # (684 - 64) GB / (256 KiB x 33,280)
    assert replace(lp, inflight="any version").replica_slots == 63


def test_pull_and_publish_bytes_follow_the_parameter_server() -> None:
    lp = Loop(ps=Setting(delta_ratio=4.0, full_every=10))
    full = 64e9 * 0.5 * 2  # through the egress: each of 2 hosts half of it
    delta = full / 4
    assert pull_cost(lp, 16, 17)[0] == pytest.approx(delta)  # the next version: one delta
    assert pull_cost(lp, 12, 17)[0] == pytest.approx(5 * delta)  # a chain from the one held
    # Held within one cycle before the anchor (v10): the chain, even where longer.
    assert pull_cost(lp, 5, 17)[0] == pytest.approx(12 * delta)
    assert pull_cost(lp, 5, 27)[0] == pytest.approx(full + 7 * delta)  # v20 and 7 deltas
    assert pull_cost(lp, None, 20)[0] == pytest.approx(full)
    assert pull_cost(lp, 16, 17)[1] == pytest.approx(16e9 * 0.5 / HOST)
    full_mode = replace(lp, publishing=MODES[1])
    assert pull_cost(full_mode, 16, 17)[0] == pytest.approx(64e9 * 2)  # whole model per host
    assert publish_seconds(lp, 0) == pytest.approx(64e9 / HOST)
    assert publish_seconds(lp, 10) == pytest.approx(80e9 / HOST)  # full, and its delta
    assert publish_seconds(lp, 11) == pytest.approx(16e9 / HOST)


def test_lengths_and_determinism() -> None:
    geometric = Lengths(mean=50.0, cap=120)
    draws = geometric.draw(random.Random(0), 20_000)
    assert max(draws) == 120 and min(draws) >= 1
    # The mean of min(geometric, cap) = mean x (1 - (1 - 1/mean)^cap).
    assert statistics.fmean(draws) == pytest.approx(50 * (1 - (1 - 1 / 50) ** 120), rel=0.02)
    resampled = Lengths(mean=20.0, cap=25, sample=(5, 15)).draw(random.Random(0), 100)
    assert set(resampled) == {10, 25}  # scaled x2 to mean 20, 30 capped at 25
    case = replace(Loop(), max_staleness=2, steps=20)
    assert simulate(case) == simulate(case)
    with pytest.raises(ValueError, match="allowed"):
        Loop(inflight="sometimes")
