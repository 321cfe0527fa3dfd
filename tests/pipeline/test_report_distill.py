"""The report's Distillation section (on-policy distillation) on hand-built records: the
teacher's identity, the reverse KL at a few steps, and each version's gap to the teacher,
paired per problem where the per-sample tables allow it (hand-computed values)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from pipeline.layout import TEACHER_EVAL, eval_key, teacher_stream
from pipeline.metrics import per_problem_pass
from pipeline.parquet_bytes import table_to_bytes
from pipeline.report import REPORT_KEY, build_report, spread, teacher_gap
from pipeline.run import Run
from pipeline.teacher import PIN_KEY
from tests.runs import tiny_config

EVAL = ("eval.num_samples=4", "eval.ks=[1,4]", "eval.bootstrap=200")
TEACHER_URL = "/elsewhere/teacher-run"
DIGEST = "sha256:" + "ab" * 32


def columns(correct_counts: list[int], n: int = 4) -> dict[str, list]:
    """Per-sample columns of an evaluation: problem p has correct_counts[p] of n correct."""
    return {
        "problem_id": [f"p{p}" for p, _ in enumerate(correct_counts) for _ in range(n)],
        "reward": [float(s < c) for c in correct_counts for s in range(n)],
    }


def test_per_problem_pass_counts_each_problem_whatever_the_row_order():
    cols = columns([4, 2, 0])
    order = np.random.default_rng(0).permutation(12)
    shuffled = {k: [v[i] for i in order] for k, v in cols.items()}
    # pass@1 = c / n; pass@4 of 4 samples: 1 iff any is correct.
    assert per_problem_pass(shuffled, 1) == {"p0": 1.0, "p1": 0.5, "p2": 0.0}
    assert per_problem_pass(shuffled, 4) == {"p0": 1.0, "p1": 1.0, "p2": 0.0}
    # pass@2 of p1 (2 of 4 correct): 1 - C(2,2)/C(4,2) = 5/6
    assert per_problem_pass(cols, 2)["p1"] == pytest.approx(5 / 6)
    assert per_problem_pass(cols, 5) is None  # 4 samples cannot give pass@5


def test_teacher_gap_is_paired_per_problem():
    teacher, student = columns([4, 2, 0]), columns([3, 2, 0])
    # pass@1 per problem: student 0.75, 0.5, 0 against 1, 0.5, 0: differences -0.25, 0, 0.
    gap = teacher_gap(student, teacher, 1, n_boot=500, seed=0)
    assert gap["mean"] == pytest.approx(-0.25 / 3)
    assert -0.25 <= gap["lo"] <= gap["mean"] <= gap["hi"] <= 0.0
    # pass@4 is the same on every problem: a paired interval of exactly 0 (unpaired
    # intervals of 2/3 over 3 problems would not be).
    assert teacher_gap(student, teacher, 4, n_boot=500, seed=0) == {
        "mean": 0.0,
        "lo": 0.0,
        "hi": 0.0,
    }
    other = columns([1, 1, 1, 1])  # a fourth problem: nothing to pair it with
    assert teacher_gap(other, teacher, 1, n_boot=50, seed=0) is None


def _record(version: int, pass1: float, pass4: float) -> dict:
    return {
        "version": version,
        "num_problems": 3,
        "num_samples": 4,
        "ks": [1, 4],
        "metrics": {
            "pass@1": {"mean": pass1, "lo": pass1 - 0.1, "hi": pass1 + 0.1},
            "pass@4": {"mean": pass4, "lo": pass4 - 0.1, "hi": pass4 + 0.1},
        },
    }


def _table(version: int, correct_counts: list[int]) -> bytes:
    cols = columns(correct_counts)
    return table_to_bytes(
        pa.table({**cols, "version": np.full(len(cols["reward"]), version, np.int64)})
    )


def test_report_of_a_run_with_a_teacher_has_the_distillation_section(tmp_path):
    run = Run.create(
        str(tmp_path / "student"),
        tiny_config(*EVAL, "trainer.algorithm=opd", f"distill.teacher={TEACHER_URL}"),
    )
    pin = {"run": TEACHER_URL, "version": 7, "digest": DIGEST, "requested": "latest"}
    run.store.write_new(PIN_KEY, json.dumps(pin).encode())
    for step in range(1, 11):  # reverse KL 1.0, 0.9, ... 0.1
        run.log_metrics(
            "train", step, {"step": step, "reward_mean": 0.5, "reverse_kl": 1.1 - step / 10}
        )
    run.log_metrics(teacher_stream("eval"), 0, _record(0, 0.5, 2 / 3))
    run.store.write_new(eval_key(TEACHER_EVAL, 4, 4), _table(0, [4, 2, 0]))
    run.log_metrics("eval", 0, _record(0, 5 / 12, 2 / 3))
    run.store.write_new(eval_key(0, 4, 4), _table(0, [3, 2, 0]))
    run.log_metrics("eval", 2, _record(2, 0.6, 0.8))  # no per-sample table: no interval

    md = build_report(run)
    section = md.split("## Distillation", 1)[1].split("\n## ", 1)[0]
    assert f"teacher: {TEACHER_URL} @ v7 ({DIGEST[:19]}); requested version `latest`" in section
    assert "algorithm `opd`" in section and "distill_coef" not in section
    firsts = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("|")]
    # steps 1..10 spread over 6 rows: the first, the last, evenly between
    assert [c for c in firsts if c.isdigit()] == ["1", "3", "5", "6", "8", "10"]
    assert "| 10 | 0.1000 |" in section and "| 1 | 1.0000 |" in section
    assert "The teacher on the held-out set (n=4): pass@1 0.500 [0.400, 0.600], pass@4" in section
    v0 = next(line for line in section.splitlines() if line.startswith("| v0 |"))
    gap1, gap4 = (c.strip() for c in v0.split("|")[2:4])
    assert gap1.startswith("-0.083 [") and gap4 == "0.000 [0.000, 0.000]"
    # v2 pairs with nothing: the difference of the records' means, no interval.
    assert "| v2 | 0.100 | 0.133 |" in section
    assert "![distillation](distill.png)" in section
    assert run.store.read("report/distill.png").startswith(b"\x89PNG")
    assert run.store.read(REPORT_KEY).decode() == md


def test_a_run_without_a_teacher_has_no_distillation_section(tmp_path):
    run = Run.create(str(tmp_path / "plain"), tiny_config(*EVAL))
    run.log_metrics("train", 1, {"step": 1, "reward_mean": 0.5})
    run.log_metrics("eval", 0, _record(0, 0.5, 2 / 3))
    md = build_report(run)
    assert "Distillation" not in md and not run.store.exists("report/distill.png")


def test_spread_keeps_the_ends():
    assert spread(list(range(10)), 6) == [0, 2, 4, 5, 7, 9]
    assert spread([1, 2], 6) == [1, 2]
