"""The whole job on a fixture with every kind of problem planted: exact counts per step,
every malformed row in the dead-letter output with its reason, idempotent re-runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from beam_jobs import curate
from pipeline.tasks.base import Problem
from tests.beam_jobs.fixtures import MAX_ROW_BYTES, write_fixture

ROOT = Path(__file__).resolve().parents[2]


def args_for(root: Path, out: str, *extra: str) -> list[str]:
    return [
        "--input", str(root / "in" / "*.jsonl"),
        "--input", str(root / "in" / "*.parquet"),
        "--input", str(root / "in" / "*.csv"),
        "--eval-sets", str(root / "eval" / "*.jsonl"),
        "--output", out,
        "--max-row-bytes", str(MAX_ROW_BYTES),
        "--val-fraction", "0.25",
        *extra,
    ]  # fmt: skip


def read_output(out: Path, name: str) -> list[dict]:
    rows = []
    for f in sorted((out / name).glob("part-*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return rows


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("curate")
    expected = write_fixture(root)
    out = root / "out"
    stats = curate.run(curate.parse_args(args_for(root, str(out))))
    return root, out, expected, stats


def test_counts_per_step_are_exact(first_run):
    _, _, exp, stats = first_run
    steps = {s["step"]: s for s in stats["steps"]}
    assert stats["rows_in"] == exp.rows_in
    assert steps["parse"]["out"] == exp.rows_in - len(exp.dead)
    reasons: dict[str, int] = {}
    for reason in exp.dead.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    assert steps["parse"]["removed"] == reasons
    assert steps["exact_dedup"]["removed"] == {"exact_duplicate": 3, "duplicate_problem_id": 1}
    assert steps["near_dedup"]["removed"] == {"near_duplicate": 2}
    assert steps["decontaminate"]["removed"] == {"contaminated": 2}
    assert steps["difficulty"] == {
        "step": "difficulty",
        "applied": False,
        "in": len(exp.kept),
        "out": len(exp.kept),
        "removed": {},
    }
    split = steps["split"]
    assert split["in"] == len(exp.kept) == split["train"] + split["validation"]
    assert split["validation"] > 0
    assert stats["eval_sets"] == {
        "gsm8k_test": {"rows": 3, "unparseable": 0, "contaminated_train_rows": 1},
        "math_test": {"rows": 2, "unparseable": 0, "contaminated_train_rows": 1},
    }
    per_source = stats["sources"]
    assert sum(s["in"] for s in per_source.values()) == exp.rows_in
    csv = next(v for k, v in per_source.items() if k.endswith("c_rlax.csv"))
    assert csv["dead_letter"] == {"invalid_row": 1, "invalid_field": 1}
    assert csv["removed"] == {"exact_dedup": 1}


def test_every_malformed_row_is_dead_lettered_with_its_reason(first_run):
    _, out, exp, _ = first_run
    dead = read_output(out, "dead_letter")
    assert {(r["source"], r["row"]): r["reason"] for r in dead} == exp.dead
    assert all(r["detail"] for r in dead)
    oversized = next(r for r in dead if r["reason"] == "oversized")
    assert len(oversized["raw"]) <= 4096  # a preview, not the whole row
    bad_utf8 = next(r for r in dead if r["reason"] == "invalid_utf8" and r["source"].endswith("l"))
    assert "\\xe9" in bad_utf8["raw"]  # the offending byte is visible


def test_removed_rows_name_their_survivor_or_eval_set(first_run):
    _, out, exp, _ = first_run
    removed = {(r["source"], r["row"]): r for r in read_output(out, "removed")}
    assert {k: (r["step"], r["reason"]) for k, r in removed.items()} == exp.removed
    for key, ref in exp.duplicate_of.items():
        assert (removed[key]["duplicate_of_source"], removed[key]["duplicate_of_row"]) == ref
    for key, eval_set in exp.eval_hits.items():
        assert removed[key]["eval_sets"] == eval_set
        assert removed[key]["eval_problem_id"]


def test_kept_rows_are_aligned_problems(first_run):
    _, out, exp, _ = first_run
    train, val = read_output(out, "train"), read_output(out, "validation")
    kept = train + val
    assert {(r["source"], r["row"]) for r in kept} == exp.kept
    assert len({r["problem_id"] for r in kept}) == len(kept)
    assert [r["problem_id"] for r in train] == sorted(r["problem_id"] for r in train)
    by_task = {r["task"] for r in kept}
    assert by_task == {"math", "countdown"}  # GSM8K rows are math problems
    gsm = next(r for r in kept if r["schema"] == "gsm8k" and r["row"] == 0)
    assert gsm["answer"] == "1000"  # "#### 1,000" canonicalised
    assert gsm["problem"] in gsm["prompt"]
    assert json.loads(gsm["meta"])["solution"].endswith("#### 1,000")
    rlax = next(r for r in kept if r["task"] == "countdown")
    assert rlax["problem_id"].startswith("rx") and json.loads(rlax["meta"])["target"] >= 0
    problems = [Problem.from_dict(r) for r in kept]  # the trainer's row type, as read
    assert {p.problem_id for p in problems} == {r["problem_id"] for r in kept}
    math = next(r for r in kept if r["schema"] == "math")
    assert math["answer"].startswith(r"\frac{1}{")
    assert json.loads(math["meta"])["level"].startswith("Level")


def test_rerun_skips_and_overwrite_is_byte_identical(first_run, tmp_path):
    root, out, _, stats = first_run
    manifest = (out / "_SUCCESS").read_bytes()
    mtime = (out / "stats.json").stat().st_mtime_ns
    again = curate.run(curate.parse_args(args_for(root, str(out))))
    assert again == stats and (out / "stats.json").stat().st_mtime_ns == mtime  # skipped
    # Recompute elsewhere with two workers and tiny spill runs: same bytes.
    other = tmp_path / "other"
    curate.run(
        curate.parse_args(
            args_for(
                root,
                str(other),
                "--spill-rows",
                "2",
                "--direct_num_workers",
                "2",
                "--direct_running_mode",
                "multi_threading",
            )
        )
    )
    assert (other / "_SUCCESS").read_bytes() == manifest
    for rel in json.loads(manifest)["files"]:
        assert (other / rel).read_bytes() == (out / rel).read_bytes(), rel
    assert not list(tmp_path.glob("*.staging-*"))  # staging moved into place


def test_output_of_other_inputs_is_not_overwritten(first_run):
    root, out, _, _ = first_run
    with pytest.raises(curate.CurateError, match="choose another --output or pass --overwrite"):
        curate.run(curate.parse_args(args_for(root, str(out), "--seed", "9")))


def test_pass_rate_band(first_run, tmp_path):
    root, out, exp, _ = first_run
    kept = sorted(
        r["problem_id"] for r in read_output(out, "train") + read_output(out, "validation")
    )
    rates = {pid: 0.5 for pid in kept}
    rates[kept[0]] = 0.0  # too hard
    rates[kept[1]] = 0.05
    rates[kept[2]] = 1.0  # too easy
    del rates[kept[3]]  # never measured
    ids = sorted(rates)
    path = tmp_path / "rates.parquet"
    pq.write_table(
        pa.table(
            {
                "problem_id": ids,
                "pass_rate": [rates[i] for i in ids],
                "k": [8] * len(ids),
                "version": [3] * len(ids),
            }
        ),
        path,
    )
    stats = curate.run(
        curate.parse_args(args_for(root, str(tmp_path / "banded"), "--pass-rates", str(path)))
    )
    steps = {s["step"]: s for s in stats["steps"]}
    assert steps["difficulty"]["removed"] == {
        "below_min_pass_rate": 2,
        "above_max_pass_rate": 1,
        "no_pass_rate": 1,
    }
    assert steps["split"]["in"] == len(exp.kept) - 4
    train = read_output(tmp_path / "banded", "train")
    assert {r["pass_rate"] for r in train} == {0.5}


def test_cli_reports_bad_arguments(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "beam_jobs.curate",
            "--input",
            str(tmp_path / "none*.jsonl"),
            "--output",
            str(tmp_path / "o"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--input" in proc.stderr and "matched no files" in proc.stderr
