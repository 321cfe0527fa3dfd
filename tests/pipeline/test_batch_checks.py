"""pipeline.batch_checks: each bad batch the integrity probe planted is refused with a
message naming the column and row; a good batch passes unchanged."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.batch_checks import BadBatchError, BatchLimits, read_checked
from pipeline.parquet_bytes import table_from_bytes
from pipeline.rollouts import RolloutBatch, from_parquet_bytes, to_parquet_bytes

G, GROUPS, VOCAB = 2, 2, 56
LIMITS = BatchLimits(
    index=7,
    group_size=G,
    max_rows=G * GROUPS,
    vocab_size=VOCAB,
    max_prompt_tokens=8,
    max_completion_tokens=6,
    policy_version=3,
    reward_range=(0.0, 1.0),
    allow_empty=False,
)


def good_batch() -> RolloutBatch:
    n = G * GROUPS
    return RolloutBatch(
        batch_index=7,
        prompt_pos=np.repeat(np.arange(GROUPS), G),
        prompt_id=[f"p{i // G}" for i in range(n)],
        task=["arithmetic"] * n,
        sample_index=np.tile(np.arange(G), GROUPS),
        prompt_ids=[[1, 10, 11, 12]] * n,
        completion_ids=[[13, 14, 2], [15, 2], [16], [17, 18, 19, 2]],
        behaviour_logprobs=[[-0.5, -1.0, -0.1], [-2.0, -0.3], [-0.7], [-0.2] * 4],
        completion=["a", "b", "c", "d"],
        finished=np.ones(n, bool),
        reward=np.asarray([1.0, 0.0, 0.0, 1.0], np.float32),
        policy_version=3,
        worker_id="w0",
    )


def with_column(data: bytes, name: str, values, type_=None) -> bytes:
    table = table_from_bytes(data)
    i = table.column_names.index(name)
    col = pa.array(values, type=type_ or table.schema.field(name).type)
    table = table.set_column(i, pa.field(name, col.type), col)
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def test_a_good_batch_passes_unchanged():
    data = to_parquet_bytes(good_batch())
    got = read_checked(data, LIMITS)
    ref = from_parquet_bytes(data)
    assert got.completion_ids == ref.completion_ids
    assert got.reward.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_rewards_at_the_ends_of_the_range_pass():
    data = with_column(to_parquet_bytes(good_batch()), "reward", [-1.0, 1.0, 0.0, 0.5])
    assert read_checked(data, BatchLimits(**{**LIMITS.__dict__, "reward_range": (-1.0, 1.0)}))


def _tokens(row: int, token: int) -> list[list[int]]:
    ids = [list(c) for c in good_batch().completion_ids]
    ids[row][0] = token
    return ids


BAD = {
    "nan reward": ("reward", [1.0, float("nan"), 0.0, 1.0], r"row 1: reward is nan"),
    "inf reward": ("reward", [1.0, 0.0, float("inf"), 1.0], r"row 2: reward is inf"),
    "reward above range": ("reward", [1.0, 0.0, 0.0, 7.0], r"row 3: reward is 7.0"),
    "token id 10^6": ("completion_ids", _tokens(2, 10**6), r"row 2: .*token id 1000000"),
    "token id -5": ("completion_ids", _tokens(1, -5), r"row 1: .*token id -5; allowed: 0..55"),
    "batch_index not the name": ("batch_index", [9] * 4, "batch_index column is 9, but .* 7"),
    "future policy_version": ("policy_version", [5] * 4, "policy_version is 5; batch 7 .* 3 only"),
    # published, but not the version the schedule pins batch 7 to: checked by rule, not range
    "older policy_version": ("policy_version", [0] * 4, "policy_version is 0; batch 7 .* 3 only"),
    "mixed policy_version": ("policy_version", [3, 3, 2, 3], "one value per batch"),
    "logprobs of wrong length": (
        "behaviour_logprobs",
        [[-0.5, -1.0], [-2.0, -0.3], [-0.7], [-0.2] * 4],
        "row 0: behaviour_logprobs has 2 entries for 3 completion tokens",
    ),
    "logprob nan": (
        "behaviour_logprobs",
        [[-0.5, -1.0, -0.1], [float("nan"), -0.3], [-0.7], [-0.2] * 4],
        "row 1: behaviour_logprobs holds nan",
    ),
    "positive logprob": (
        "behaviour_logprobs",
        [[-0.5, -1.0, -0.1], [-2.0, -0.3], [3.0], [-0.2] * 4],
        "row 2: behaviour_logprobs holds 3.0",
    ),
    "completion too long": (
        "completion_ids",
        [[13, 14, 2], [15, 2], [16] * 7, [17, 18, 19, 2]],
        "row 2: completion_ids has 7 tokens; at most 6",
    ),
    "group out of order": ("sample_index", [0, 1, 1, 0], r"group 1 \(rows 2..3\)"),
    "kind unknown": ("kind", ["solve", "solve", "cheat", "solve"], "row 2: kind is not one of"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_planted_bad_value_is_refused_naming_its_row(case):
    column, values, message = BAD[case]
    data = with_column(to_parquet_bytes(good_batch()), column, values)
    with pytest.raises(BadBatchError, match=message):
        read_checked(data, LIMITS)


def test_a_column_of_the_wrong_type_is_refused():
    data = with_column(
        to_parquet_bytes(good_batch()),
        "behaviour_logprobs",
        [["a"], ["b"], ["c"], ["d"]],
        pa.list_(pa.string()),
    )
    with pytest.raises(
        BadBatchError, match="column behaviour_logprobs is list<.*string>; expected"
    ):
        read_checked(data, LIMITS)


def test_garbage_bytes_are_refused_as_unreadable():
    with pytest.raises(BadBatchError, match="not a readable Parquet file"):
        read_checked(b"PAR1 this is not parquet", LIMITS)


def test_an_empty_batch_is_refused_unless_dynamic_sampling_may_commit_one():
    empty = table_from_bytes(to_parquet_bytes(good_batch())).slice(0, 0)
    sink = io.BytesIO()
    pq.write_table(empty, sink)
    with pytest.raises(BadBatchError, match="has no rows"):
        read_checked(sink.getvalue(), LIMITS)
    dynamic = BatchLimits(**{**LIMITS.__dict__, "allow_empty": True})
    assert read_checked(sink.getvalue(), dynamic) is None


def test_too_many_rows_are_refused():
    lim = BatchLimits(**{**LIMITS.__dict__, "max_rows": 2})
    with pytest.raises(BadBatchError, match="has 4 rows; allowed: whole groups of G=2, at most 2"):
        read_checked(to_parquet_bytes(good_batch()), lim)


def episode_batch() -> RolloutBatch:
    """good_batch() with tool-episode columns: rows 0-1 single-turn, 2-3 episodes."""
    b = good_batch()
    b.turns = [None, None, 1, 3]
    b.tool_calls = [None, None, 0, 2]
    b.tool_errors = [None, None, [], ["timeout"]]
    b.loss_mask = [None, None, [1], [1, 0, 0, 1]]
    return b


def test_an_episode_batch_passes_and_round_trips():
    got = read_checked(to_parquet_bytes(episode_batch()), LIMITS)
    assert got.turns == [None, None, 1, 3] and got.tool_calls == [None, None, 0, 2]
    assert got.tool_errors == [None, None, [], ["timeout"]]
    assert got.is_episode().tolist() == [False, False, True, True]
    assert got.token_mask(3) == [1, 0, 0, 1] and got.token_mask(0) == [1, 1, 1]


EPISODE_BAD = {
    "turns without tool_calls": ("turns", [1, None, 1, 3], "row 0: turns and tool_calls"),
    "zero turns": ("turns", [None, None, 0, 3], "row 2: turns is 0; allowed: >= 1"),
    "more calls than turns": ("tool_calls", [None, None, 2, 2], "row 2: tool_calls is 2 for 1"),
    "unknown error kind": (
        "tool_errors",
        [None, None, [], ["boom"]],
        "row 3: tool_errors holds 'boom'; allowed: malformed",
    ),
    "more errors than calls": (
        "tool_errors",
        [None, None, ["error"], ["timeout"]],
        "row 2: 1 tool_errors for 0 tool calls",
    ),
}


@pytest.mark.parametrize("case", sorted(EPISODE_BAD))
def test_a_planted_bad_episode_value_is_refused_naming_its_row(case):
    column, values, message = EPISODE_BAD[case]
    data = with_column(to_parquet_bytes(episode_batch()), column, values)
    with pytest.raises(BadBatchError, match=message):
        read_checked(data, LIMITS)


# --------------------------------------------------------------------------- routing replay

LAYERS, K, EXPERTS = 2, 2, 4
MOE_LIMITS = replace(LIMITS, num_experts=EXPERTS, routing_width=LAYERS * K)


def routing_batch() -> RolloutBatch:
    """good_batch with a routing record per row: token t, layer l, pick j -> (t + l + j) % E,
    the last token not recorded (E)."""
    batch = good_batch()
    rows = []
    for prompt, completion in zip(batch.prompt_ids, batch.completion_ids, strict=True):
        t = np.arange(len(prompt) + len(completion))[:, None, None]
        r = (t + np.arange(LAYERS)[:, None] + np.arange(K)) % EXPERTS
        r[-1] = EXPERTS
        rows.append(r.astype(np.uint8).reshape(-1))
    batch.routing = rows
    return batch


def test_a_routing_batch_round_trips_in_uint8_and_a_dense_batch_has_no_routing_column():
    batch = routing_batch()
    data = to_parquet_bytes(batch)
    assert table_from_bytes(data).schema.field("routing").type == pa.list_(pa.uint8())
    back = read_checked(data, MOE_LIMITS)
    for want, got in zip(batch.routing, back.routing, strict=True):
        assert got.dtype == np.uint8 and np.array_equal(got, want)
    dense = to_parquet_bytes(good_batch())
    assert "routing" not in table_from_bytes(dense).column_names
    assert read_checked(dense, LIMITS).routing is None
    # The column costs about a byte per (token, layer, pick) before compression.
    assert len(data) - len(dense) < 2 * sum(r.size for r in batch.routing) + 1024


def test_bad_routing_is_refused_naming_its_row():
    batch = routing_batch()
    with pytest.raises(BadBatchError, match="has a routing column, but the model is dense"):
        read_checked(to_parquet_bytes(batch), LIMITS)
    short = routing_batch()
    short.routing[2] = short.routing[2][:-1]
    with pytest.raises(ValueError, match="row 2: routing has 19 entries for 5 tokens"):
        to_parquet_bytes(short)  # the writer refuses what is not tokens x layers x k
    wide = routing_batch()
    wide.routing[1] = np.concatenate([wide.routing[1]] * 2)  # 12 tokens' worth for 6
    with pytest.raises(BadBatchError, match="row 1: routing has 48 entries for 6 tokens"):
        read_checked(to_parquet_bytes(wide), MOE_LIMITS)
    high = routing_batch()
    high.routing[3] = high.routing[3].copy()
    high.routing[3][5] = EXPERTS + 1
    with pytest.raises(BadBatchError, match=r"row 3: routing holds expert 5; allowed: 0..3, or 4"):
        read_checked(to_parquet_bytes(high), MOE_LIMITS)
    with pytest.raises(
        BadBatchError, match="column routing is list<.*uint8>; expected a list of uint16"
    ):
        read_checked(to_parquet_bytes(batch), replace(MOE_LIMITS, num_experts=300))


# ------------------------------------------------------------- on-policy distillation

TEACHER_LIMITS = replace(LIMITS, teacher=True)
# Exact in float32, so the round trip compares with ==.
TEACHER_LOGPROBS = [[-0.25, -1.5, -0.125], [-3.0, -0.5], [-0.75], [-0.0625, -2.0, -1.0, -0.25]]


def teacher_batch() -> RolloutBatch:
    batch = good_batch()
    batch.teacher_logprobs = [list(r) for r in TEACHER_LOGPROBS]
    return batch


def masked_teacher_batch() -> RolloutBatch:
    """episode_batch (rows 0-1 without a loss mask, row 3's mask [1, 0, 0, 1]) with the
    teacher's log-probs, 0 on row 3's observation tokens."""
    batch = episode_batch()
    batch.teacher_logprobs = [[-0.25, -1.5, -0.125], [-3.0, -0.5], [-0.75], [-0.5, 0.0, 0.0, -1.0]]
    return batch


def test_the_teacher_column_round_trips():
    for make in (teacher_batch, masked_teacher_batch):
        batch = make()
        data = to_parquet_bytes(batch)
        assert table_from_bytes(data).schema.field("teacher_logprobs").type == pa.list_(
            pa.float32()
        )
        got = read_checked(data, TEACHER_LIMITS)
        assert got.teacher_logprobs == batch.teacher_logprobs
        assert got.completion_ids == batch.completion_ids


def test_a_batch_without_a_teacher_has_the_bytes_it_had_before_the_column_existed():
    """The sha256 of these batches' bytes as written at e8a232c, the commit before the
    teacher column (pyarrow 25.0.1, pinned in uv.lock: an upgrade may change the bytes of
    every batch, and then these digests are recomputed from that commit)."""
    import hashlib

    before = {
        "good": "b02842dd0f6a8bc05003eb1b22889d991a338dea4326cd0b73056e739ef62c77",
        "episode": "1baee17ed4fd70b2b2fc19043b1d284d1418d2d7741d61f901f9c524d14f7a72",
    }
    for name, make in (("good", good_batch), ("episode", episode_batch)):
        data = to_parquet_bytes(make())
        assert "teacher_logprobs" not in table_from_bytes(data).column_names
        assert hashlib.sha256(data).hexdigest() == before[name], name
        assert read_checked(data, LIMITS).teacher_logprobs is None


def test_the_writer_refuses_teacher_rows_that_do_not_match_the_completions():
    short = teacher_batch()
    short.teacher_logprobs[1] = [-3.0]
    with pytest.raises(ValueError, match="row 1: teacher_logprobs has 1 entries for 2 completion"):
        to_parquet_bytes(short)
    few = teacher_batch()
    few.teacher_logprobs = few.teacher_logprobs[:3]
    with pytest.raises(ValueError, match="has 3 teacher_logprobs rows for 4"):
        to_parquet_bytes(few)


def _with_teacher(values, batch=None, type_=None) -> bytes:
    return with_column(
        to_parquet_bytes(batch or teacher_batch()), "teacher_logprobs", values, type_
    )


TEACHER_BAD = {
    "wrong length": (
        [[-0.25, -1.5], [-3.0, -0.5], [-0.75], [-0.0625, -2.0, -1.0, -0.25]],
        "row 0: teacher_logprobs has 2 entries for 3 completion tokens; one entry per token",
    ),
    "a row too long": (
        [[-0.25, -1.5, -0.125], [-3.0, -0.5], [-0.75, -0.5], [-0.0625, -2.0, -1.0, -0.25]],
        "row 2: teacher_logprobs has 2 entries for 1 completion tokens",
    ),
    "a null row": (
        [[-0.25, -1.5, -0.125], [-3.0, -0.5], None, [-0.0625, -2.0, -1.0, -0.25]],
        "row 2: teacher_logprobs is null for 1 completion tokens",
    ),
    "nan": (
        [[-0.25, -1.5, -0.125], [float("nan"), -0.5], [-0.75], [-0.0625, -2.0, -1.0, -0.25]],
        r"row 1: teacher_logprobs holds nan; a log-probability is finite and <= 0",
    ),
    "-inf": (
        [[-0.25, -1.5, -0.125], [-3.0, -0.5], [-0.75], [-0.0625, -2.0, float("-inf"), -0.25]],
        r"row 3: teacher_logprobs holds -inf; a log-probability is finite and <= 0",
    ),
    "positive": (
        [[-0.25, -1.5, -0.125], [-3.0, -0.5], [0.5], [-0.0625, -2.0, -1.0, -0.25]],
        r"row 2: teacher_logprobs holds 0.5; a log-probability is finite and <= 0",
    ),
}


@pytest.mark.parametrize("case", sorted(TEACHER_BAD))
def test_a_planted_bad_teacher_value_is_refused_naming_its_row(case):
    values, message = TEACHER_BAD[case]
    with pytest.raises(BadBatchError, match=message):
        read_checked(_with_teacher(values), TEACHER_LIMITS)


def test_the_teacher_column_is_present_exactly_in_a_run_with_a_teacher():
    with pytest.raises(
        BadBatchError, match=r"has a teacher_logprobs column, but the run has no teacher"
    ):
        read_checked(to_parquet_bytes(teacher_batch()), LIMITS)
    with pytest.raises(
        BadBatchError, match=r"lacks the teacher_logprobs column; the run distils from a teacher"
    ):
        read_checked(to_parquet_bytes(good_batch()), TEACHER_LIMITS)
    doubles = _with_teacher(TEACHER_LOGPROBS, type_=pa.list_(pa.float64()))
    with pytest.raises(
        BadBatchError, match=r"column teacher_logprobs is list<.*double>; expected list<.*float>"
    ):
        read_checked(doubles, TEACHER_LIMITS)


def test_a_teacher_value_off_the_loss_mask_is_refused_with_null_mask_rows_mixed_in():
    """Rows without a loss mask (null: all tokens sampled) sit between rows with one, so
    the check lines each mask up with its own row's values."""
    batch = masked_teacher_batch()
    # row 0 has no mask: any log-prob is fine on every token; row 3's 0s are its holes
    assert read_checked(to_parquet_bytes(batch), TEACHER_LIMITS) is not None
    bad = [list(r) for r in batch.teacher_logprobs]
    bad[3][2] = -0.5  # the second observation token of row 3
    with pytest.raises(
        BadBatchError,
        match=r"row 3: teacher_logprobs holds -0.5 on a token off the loss mask; allowed: 0",
    ):
        read_checked(_with_teacher(bad, masked_teacher_batch()), TEACHER_LIMITS)
    # a mask on the first row and none on the next: a mask's zeros must not shift rows
    first = masked_teacher_batch()
    first.loss_mask = [[1, 0, 1], None, [1], None]
    first.teacher_logprobs = [[-0.25, 0.0, -0.125], [-3.0, -0.5], [-0.75], TEACHER_LOGPROBS[3]]
    assert read_checked(to_parquet_bytes(first), TEACHER_LIMITS) is not None
    first.teacher_logprobs[0][1] = -1.0
    with pytest.raises(BadBatchError, match=r"row 0: teacher_logprobs holds -1.0 on a token off"):
        read_checked(to_parquet_bytes(first), TEACHER_LIMITS)
