"""The evaluator's evaluation of a run's pinned teacher (on-policy distillation): pinned
by the evaluator when no job has, sampled with the teacher's own model shape, and the
same samples and metrics as the teacher run's own evaluation of that snapshot (same
problems, keys and settings); create-only, so a retry skips it; the report sets the
student's versions against it. Trains a small teacher: `distill` lane."""

from __future__ import annotations

import pytest

from pipeline.layout import TEACHER_EVAL, eval_key, teacher_stream
from pipeline.paramserver import ParamServer
from pipeline.parquet_bytes import table_from_bytes
from pipeline.run import Run, base_server
from pipeline.teacher import read_pin
from tests.runs import clone_run, make_base, tiny_config

pytestmark = pytest.mark.distill

SETTINGS = (
    "sampler.max_new_tokens=32",
    "eval.num_problems=8",
    "eval.num_samples=4",
    "eval.ks=[1,4]",
    "eval.bootstrap=100",
)


def publish_base_as_v0(run: Run) -> None:
    ps = ParamServer(run.store)
    ps.publish(0, dict(base_server(run).pull(0).tensors), epoch=ps.acquire_epoch())


def test_the_teacher_is_evaluated_once_as_its_own_run_evaluates_it(tmp_path):
    from pipeline.report import build_report
    from tpu_jobs.evaluator import Evaluator, main
    from tpu_jobs.sft import train_sft

    teacher = make_base(str(tmp_path / "teacher"), tiny_config(*SETTINGS, "sft.steps=20"))
    publish_base_as_v0(teacher)
    # The reference: the teacher run evaluating that snapshot itself.
    reference = Evaluator(teacher, log=lambda m: None).evaluate(0)
    ref_table = table_from_bytes(teacher.store.read(eval_key(0))).to_pydict()

    student_cfg = tiny_config(
        *SETTINGS,
        "sft.steps=0",
        "model.hidden_size=32",  # another shape than the teacher's 64
        "trainer.algorithm=opd",
        f"distill.teacher={teacher.url}",
        "distill.teacher_version=base",
    )
    student = clone_run(teacher, str(tmp_path / "student"), student_cfg, prefixes=("data/",))
    train_sft(student)
    publish_base_as_v0(student)
    assert read_pin(student) is None

    assert main(["--run", student.url, "--version", "0"]) == 0

    pin = read_pin(student)  # the evaluator pinned it
    assert pin is not None and pin.version == "base" and pin.run == teacher.url
    (record,) = student.read_metrics(teacher_stream("eval"))
    assert record["teacher"] == {
        "run": teacher.url,
        "version": "base",
        "digest": pin.digest,
        "requested": "base",
    }
    assert record["metrics"] == reference["metrics"]
    table = table_from_bytes(student.store.read(eval_key(TEACHER_EVAL))).to_pydict()
    for column in ("problem_id", "sample_index", "completion", "reward", "self_score"):
        assert table[column] == ref_table[column], column
    (own,) = student.read_metrics("eval")  # the student's v0, with its own model
    assert own["version"] == 0

    logs: list[str] = []
    again = Evaluator(student, log=logs.append).evaluate_teacher()  # a retry
    assert again["metrics"] == record["metrics"]
    assert logs == ["[eval] teacher already evaluated (teacher-eval); skipping"]

    md = build_report(student)
    assert f"teacher: {pin.describe()}; requested version `base`" in md
    v0 = next(line for line in md.split("## Distillation")[1].splitlines() if "| v0 |" in line)
    gap = own["metrics"]["pass@1"]["mean"] - reference["metrics"]["pass@1"]["mean"]
    cell = v0.split("|")[2].split()
    assert float(cell[0]) == pytest.approx(gap, abs=1e-3) and cell[1].startswith("[")  # paired
