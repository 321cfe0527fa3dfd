"""The failpoint table: every crash point the code hits is listed, and a bad RLAX_FAILPOINTS
value (from `rlax chaos --failpoints`) is refused naming the allowed ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.errors import ArgumentError
from pipeline.failpoints import POINTS, check_spec
from pipeline.ops.chaos import ChaosSettings

ROOT = Path(__file__).resolve().parents[2]


def test_every_failpoint_hit_in_the_code_is_in_the_table():
    hits = set()
    for package in ("pipeline", "tpu_jobs", "beam_jobs"):
        for path in (ROOT / package).rglob("*.py"):
            hits |= set(re.findall(r"failpoints\.hit\(\s*\"([^\"]+)\"", path.read_text()))
    assert hits == set(POINTS)


@pytest.mark.parametrize(
    "spec", ["", "teacher.before_pin", "rollout.before_commit@1, trainer.checkpoint_started@4"]
)
def test_valid_specs_pass(spec):
    check_spec(spec)
    assert ChaosSettings(failpoints=spec).failpoints == spec


@pytest.mark.parametrize("spec", ["teacher.befor_pin", "rollout.before_commit@x", "a,b"])
def test_a_bad_spec_is_refused_naming_the_allowed_points(spec):
    with pytest.raises(ArgumentError) as err:
        ChaosSettings(failpoints=spec)
    message = str(err.value)
    assert message.startswith("--failpoints: failpoint ") and "\n" not in message
    assert all(name in message for name in POINTS)
