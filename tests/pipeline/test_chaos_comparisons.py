"""The chaos harness's end checks beyond the final parameters: rollout batches bit-identical
but for the worker that made them, and the same teacher pinned with one verified copy.
Fast (no JAX, no processes): batches written by hand, teachers pinned from a hand-made base."""

from __future__ import annotations

import numpy as np

from pipeline.ops.chaos import batches_equal, teachers_equal
from pipeline.rollouts import RolloutBatch, batch_key, to_parquet_bytes
from pipeline.run import Run, base_server
from pipeline.teacher import PIN_KEY, pin_teacher, teacher_server
from tests.runs import tiny_config


def _batch(index: int, worker: str, teacher: list[list[float]]) -> RolloutBatch:
    return RolloutBatch(
        batch_index=index,
        prompt_pos=np.array([0, 0]),
        prompt_id=["a", "a"],
        task=["arithmetic"] * 2,
        sample_index=np.array([0, 1]),
        prompt_ids=[[1, 5], [1, 5]],
        completion_ids=[[9, 2], [8]],
        behaviour_logprobs=[[-0.5, -0.25], [-1.0]],
        completion=["x", "y"],
        finished=np.array([1, 0], bool),
        reward=np.array([1, 0], np.float32),
        policy_version=0,
        worker_id=worker,
        teacher_logprobs=teacher,
    )


def _with_batches(url: str, teachers: list[list[list[float]]], worker: str) -> Run:
    run = Run.create(url, tiny_config())
    for i, t in enumerate(teachers):
        run.store.write_new(batch_key(i), to_parquet_bytes(_batch(i, worker, t)))
    return run


def test_batches_equal_ignores_the_worker_and_sees_one_bit_of_a_teacher_logprob(tmp_path):
    rows = [[[-0.5, -0.125], [-2.0]], [[-1.0, -0.75], [-0.0]]]
    a = _with_batches(str(tmp_path / "a"), rows, "w0")
    ok, why = batches_equal(a, _with_batches(str(tmp_path / "b"), rows, "w1"))
    assert ok and why.startswith("all 2 batches bit-identical"), why
    # The next float32 after -0.125: equal to 7 digits, not in its bits.
    ulp = float(np.nextafter(np.float32(-0.125), np.float32(0)))
    off = _with_batches(str(tmp_path / "c"), [[[-0.5, ulp], [-2.0]], rows[1]], "w0")
    assert batches_equal(a, off) == (
        False,
        "rollouts/b00000000.parquet: column teacher_logprobs differs",
    )
    # -0.0 and 0.0 compare equal as numbers; the check compares bits.
    signed = _with_batches(str(tmp_path / "d"), [rows[0], [[-1.0, -0.75], [0.0]]], "w0")
    assert batches_equal(a, signed) == (
        False,
        "rollouts/b00000001.parquet: column teacher_logprobs differs",
    )
    fewer = _with_batches(str(tmp_path / "e"), rows[:1], "w0")
    assert batches_equal(a, fewer) == (False, "committed batches differ: 2 vs 1")


def _teacher(url: str, scale: float) -> Run:
    """A run whose base (version 0 of base/) is two hand-made tensors."""
    run = Run.create(url, tiny_config())
    server = base_server(run)
    tensors = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4) * scale,
        "b": np.full(4, scale, np.float32),
    }
    server.publish(0, tensors, epoch=server.acquire_epoch())
    return run


def _pinned_student(url: str, teacher: Run) -> Run:
    cfg = tiny_config(
        "trainer.algorithm=opd", f"distill.teacher={teacher.url}", "distill.teacher_version=base"
    )
    run = Run.create(url, cfg)
    pin_teacher(run)
    return run


def test_teachers_equal_needs_the_same_pin_and_one_verified_copy_in_both(tmp_path):
    plain = Run.create(str(tmp_path / "plain"), tiny_config())
    assert teachers_equal(plain, plain) == (None, "no teacher")
    teacher = _teacher(str(tmp_path / "teacher"), 0.5)
    a = _pinned_student(str(tmp_path / "a"), teacher)
    b = _pinned_student(str(tmp_path / "b"), teacher)
    ok, why = teachers_equal(a, b)
    assert ok and f"both pinned {teacher.url} @ base" in why, why
    assert why.endswith("copies begun in the chaos run: 1")
    other = _pinned_student(str(tmp_path / "c"), _teacher(str(tmp_path / "teacher2"), 0.25))
    assert teachers_equal(a, other) == (False, f"{PIN_KEY} differs")
    unpinned = Run.create(str(tmp_path / "d"), a.config)
    assert teachers_equal(a, unpinned) == (False, f"{unpinned.url} has no {PIN_KEY}")
    # A copy whose bytes no longer match the pinned digest (its manifest swapped for the
    # other teacher's) is caught, though the pin files agree.
    manifest = "weights/v00000000/manifest.json"
    key = f"teacher/{manifest}"
    b.store.delete(key)
    b.store.write_new(key, other.store.read(key))
    ok, why = teachers_equal(a, b)
    assert not ok and "is pinned" in why, why
    assert teacher_server(b).versions() == [0]
