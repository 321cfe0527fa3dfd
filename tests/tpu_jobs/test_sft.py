"""The SFT bootstrap's stopping rule: a loss target with a step cap."""

from __future__ import annotations

import pytest

from pipeline.problem_sets import write_data
from pipeline.run import Run, base_server
from tests.runs import tiny_config
from tpu_jobs.sft import train_sft

TINY = ("task.num_train=64", "sampler.max_new_tokens=32", "sft.check_every=5")


def _sft(tmp_path, name: str, *overrides: str) -> tuple[Run, dict]:
    run = Run.create(str(tmp_path / name), tiny_config(*TINY, *overrides))
    write_data(run)
    return run, train_sft(run)


def test_stops_at_the_first_check_that_meets_the_target(tmp_path):
    # Any loss of a fresh model (~log 64 = 4.2 nats a token) is under 50: the first check
    # (step 5) meets it.
    run, out = _sft(tmp_path, "met", "sft.steps=20", "sft.target_loss=50")
    assert out["steps"] == 5
    meta = base_server(run).manifest(0)["metadata"]
    assert meta["steps"] == 5 and meta["max_steps"] == 20 and meta["target_reached"] is True
    assert [r["index"] for r in run.read_metrics("sft")] == [5]
    assert meta["final_loss"] == pytest.approx(run.read_metrics("sft")[0]["loss"])


def test_runs_to_the_cap_when_the_target_is_not_met_or_off(tmp_path):
    run, out = _sft(tmp_path, "capped", "sft.steps=12", "sft.target_loss=1e-6")
    meta = base_server(run).manifest(0)["metadata"]
    assert out["steps"] == 12 and meta["target_reached"] is False
    # A check every 5 steps and one at the cap.
    assert [r["index"] for r in run.read_metrics("sft")] == [5, 10, 12]
    off, out = _sft(tmp_path, "off", "sft.steps=12")
    assert (
        out["steps"] == 12 and base_server(off).manifest(0)["metadata"]["target_reached"] is False
    )
    # The target only decides when to stop: the same steps train the same weights.
    a, b = base_server(run).pull(0).tensors, base_server(off).pull(0).tensors
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.mark.parametrize("override", ["sft.target_loss=-1", "sft.check_every=0"])
def test_bad_stopping_settings_are_refused(override):
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=override.split("=")[0]):
        tiny_config(override)
