import numpy as np
import pytest

from pipeline.rollouts import (
    RolloutBatch,
    from_parquet_bytes,
    required_version,
    to_parquet_bytes,
)
from pipeline.schedule import batch_problem_indices


def make_batch():
    return RolloutBatch(
        batch_index=7,
        prompt_pos=np.array([0, 0, 1, 1]),
        prompt_id=["a", "a", "b", "b"],
        task=["arithmetic"] * 4,
        sample_index=np.array([0, 1, 0, 1]),
        prompt_ids=[[1, 5], [1, 5], [1, 6, 7], [1, 6, 7]],
        completion_ids=[[9, 2], [8], [], [4, 4, 2]],
        behaviour_logprobs=[[-0.5, -0.25], [-1.0], [], [-0.125, -0.375, -0.75]],  # exact in f32
        completion=["x", "y", "", "zz"],
        finished=np.array([1, 0, 0, 1], bool),
        reward=np.array([1, 0, 0, 1], np.float32),
        policy_version=3,
        worker_id="w0",
    )


def test_parquet_round_trip_exact():
    b = make_batch()
    r = from_parquet_bytes(to_parquet_bytes(b))
    assert r.batch_index == 7 and r.policy_version == 3 and r.worker_id == "w0"
    assert r.completion_ids == b.completion_ids and r.prompt_ids == b.prompt_ids
    assert r.behaviour_logprobs == b.behaviour_logprobs
    np.testing.assert_array_equal(r.reward, b.reward)
    assert r.num_tokens() == 6


def test_teacher_logprobs_round_trip_exactly_and_are_absent_without_a_teacher():
    b = make_batch()
    assert from_parquet_bytes(to_parquet_bytes(b)).teacher_logprobs is None
    b.teacher_logprobs = [[-0.75, -0.5], [-2.0], [], [-0.25, -0.0625, -1.5]]  # exact in f32
    r = from_parquet_bytes(to_parquet_bytes(b))
    assert r.teacher_logprobs == b.teacher_logprobs  # the empty completion's row included
    assert r.behaviour_logprobs == b.behaviour_logprobs


def test_parquet_rejects_foreign_table():
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.table({"x": [1]}), sink)
    with pytest.raises(ValueError, match="lacks columns"):
        from_parquet_bytes(sink.getvalue())


@pytest.mark.parametrize(
    "index, every, staleness, expected",
    [(0, 1, 0, 0), (5, 1, 0, 5), (5, 1, 2, 3), (1, 1, 2, 0), (7, 2, 0, 3), (7, 2, 1, 2)],
)
def test_required_version(index, every, staleness, expected):
    assert required_version(index, every, staleness) == expected


def test_batch_schedule_deterministic_and_covers_epoch():
    n, ppb = 10, 4
    a = np.concatenate([batch_problem_indices(i, ppb, n, seed=1) for i in range(5)])
    b = np.concatenate([batch_problem_indices(i, ppb, n, seed=1) for i in range(5)])
    np.testing.assert_array_equal(a, b)
    assert sorted(a[:10]) == list(range(10))  # first epoch is a permutation
    assert sorted(a[10:20]) == list(range(10))
    c = np.concatenate([batch_problem_indices(i, ppb, n, seed=2) for i in range(5)])
    assert not np.array_equal(a, c)
