"""benchmarks/scale_model.py: the cost model's arithmetic against hand-computed values."""

from __future__ import annotations

import pytest

from benchmarks.scale_model import MODES, Setting, evaluate


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
