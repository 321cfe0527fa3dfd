"""What a rollout batch must satisfy before the trainer trains on it.

Anyone who can write to `rollouts/` (a buggy worker, a bad disk, an attacker with bucket
access) could otherwise end a run with one value: a NaN reward or a token id outside the
vocabulary makes the loss NaN, and the next published version and checkpoint carry it.
`read_checked` parses a batch object and checks it against the run's config and the
object's own name; a batch that fails raises `BadBatchError` naming the column and row, and
the trainer quarantines it (`BatchLeases.quarantine`) so a worker produces it again.

The checks run on the Arrow columns (one vectorised pass per column, no Python loop over
tokens), so they cost little next to a training step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.parquet_bytes import table_from_bytes
from pipeline.rollouts import (
    FULL_SCHEMA,
    KINDS,
    SCHEMA,
    TEACHER_TYPE,
    RolloutBatch,
    batch_from_table,
    routing_dtype,
)
from pipeline.tool_calls import ERROR_KINDS

# A sampled token's log-probability is <= 0; allow rounding of a low-precision sampler.
MAX_LOGPROB = 1e-3


class BadBatchError(ValueError):
    """A rollout batch the trainer must not train on; the message says what is wrong."""


@dataclass(frozen=True)
class BatchLimits:
    """What the run's config allows in batch `index`."""

    index: int  # the batch index the object is named for
    group_size: int
    max_rows: int  # prompts_per_batch * G
    vocab_size: int
    max_prompt_tokens: int
    max_completion_tokens: int
    # pipeline.rollouts.required_version(index, ...): the one version a worker makes this
    # batch from. Any other value, even a published one, is a batch nobody honest wrote.
    policy_version: int
    reward_range: tuple[float, float]
    allow_empty: bool  # dynamic sampling may commit a batch without any group
    # A MoE model's experts and layers x experts per token (the routing column's entries
    # per token); 0, 0 for a dense model, whose batches carry no routing.
    num_experts: int = 0
    routing_width: int = 0
    # The run distils from a teacher (`distill.teacher`): every batch carries the teacher's
    # log-probs; without one, no batch may.
    teacher: bool = False


def read_checked(data: bytes, limits: BatchLimits) -> RolloutBatch | None:
    """The batch in `data` if it passes every check; None for an allowed empty batch.

    Raises BadBatchError otherwise."""
    try:
        table = table_from_bytes(data)
    except (pa.ArrowException, OSError, ValueError) as err:
        raise BadBatchError(f"not a readable Parquet file ({type(err).__name__}: {err})") from None
    check_schema(table)
    if table.num_rows == 0:
        if limits.allow_empty:
            return None
        raise BadBatchError(
            "has no rows; only dynamic sampling (trainer.dynamic_sampling) commits empty batches"
        )
    check_rows(table, limits)
    return batch_from_table(table)


def check_schema(table: pa.Table) -> None:
    """Every required column present, without nulls; every column of its declared type."""
    missing = [n for n in SCHEMA.names if n not in table.column_names]
    if missing:
        raise BadBatchError(f"lacks columns {missing}; required: {', '.join(SCHEMA.names)}")
    for field in FULL_SCHEMA:
        if field.name not in table.column_names:
            continue
        got = table.schema.field(field.name).type
        if got != field.type:
            raise BadBatchError(f"column {field.name} is {got}; expected {field.type}")
        if field.name in SCHEMA.names and table.column(field.name).null_count:
            raise BadBatchError(f"column {field.name} has nulls; every row needs a value")


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False)


def _lists(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, row of each value, length of each row) of a list column; null rows have
    length -1 (only the optional loss_mask may have them)."""
    arr = table.column(name).combine_chunks()
    values = arr.flatten().to_numpy(zero_copy_only=False)
    rows = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
    lengths = pc.fill_null(pc.list_value_length(arr), -1).to_numpy(zero_copy_only=False)
    return values, rows, lengths


def _one_value(table: pa.Table, name: str) -> object:
    values = pc.unique(table.column(name)).to_pylist()
    if len(values) != 1:
        raise BadBatchError(f"column {name} holds {values[:5]}; one value per batch is required")
    return values[0]


def check_rows(table: pa.Table, lim: BatchLimits) -> None:
    """The row-level checks of a non-empty batch with a valid schema."""
    n, g = table.num_rows, lim.group_size
    index = _one_value(table, "batch_index")
    if index != lim.index:
        raise BadBatchError(f"batch_index column is {index}, but the object is batch {lim.index}")
    version = _one_value(table, "policy_version")
    if int(version) != lim.policy_version:
        raise BadBatchError(
            f"policy_version is {version}; batch {lim.index} is made from version "
            f"{lim.policy_version} only (pipeline.rollouts.required_version)"
        )
    _one_value(table, "worker_id")
    if n % g or n > lim.max_rows:
        raise BadBatchError(
            f"has {n} rows; allowed: whole groups of G={g}, at most {lim.max_rows} rows"
        )
    pos = _column(table, "prompt_pos").reshape(-1, g)
    sample = _column(table, "sample_index").reshape(-1, g)
    ids = np.asarray(table.column("prompt_id").to_pylist(), object).reshape(-1, g)
    bad = (pos != pos[:, :1]).any(1) | (sample != np.arange(g)).any(1) | (ids != ids[:, :1]).any(1)
    if bad.any():
        raise BadBatchError(
            f"group {_first(bad)} (rows {_first(bad) * g}..{_first(bad) * g + g - 1}) is not one "
            f"prompt with sample_index 0..{g - 1} in order"
        )
    if "kind" in table.column_names:
        kinds = pc.fill_null(table.column("kind"), "solve")
        wrong = ~np.isin(kinds.to_numpy(zero_copy_only=False), KINDS)
        if wrong.any():
            raise BadBatchError(f"row {_first(wrong)}: kind is not one of {', '.join(KINDS)}")
    _check_tokens(table, lim)
    _check_values(table, lim)
    _check_episodes(table)


def _check_tokens(table: pa.Table, lim: BatchLimits) -> None:
    limits = {"prompt_ids": lim.max_prompt_tokens, "completion_ids": lim.max_completion_tokens}
    lengths_of = {}
    for name, max_len in limits.items():
        values, rows, lengths = _lists(table, name)
        lengths_of[name] = lengths
        wrong = (values < 0) | (values >= lim.vocab_size)
        if wrong.any():
            at = _first(wrong)
            raise BadBatchError(
                f"row {rows[at]}: {name} holds token id {values[at]}; allowed: 0..{lim.vocab_size - 1}"
                " (model.vocab_size)"
            )
        too_long = lengths > max_len
        if too_long.any():
            row = _first(too_long)
            raise BadBatchError(f"row {row}: {name} has {lengths[row]} tokens; at most {max_len}")
        if name == "prompt_ids" and (lengths < 1).any():
            raise BadBatchError(f"row {_first(lengths < 1)}: prompt_ids is empty")
    completion_len = lengths_of["completion_ids"]
    _logprobs(table, "behaviour_logprobs", completion_len)
    if "loss_mask" in table.column_names:
        mask, mask_rows, mask_len = _lists(table, "loss_mask")
        wrong = (mask_len >= 0) & (mask_len != completion_len)
        if wrong.any():
            row = _first(wrong)
            raise BadBatchError(
                f"row {row}: loss_mask has {mask_len[row]} entries for {completion_len[row]} "
                "completion tokens; they must match"
            )
        wrong = (mask != 0) & (mask != 1)
        if wrong.any():
            raise BadBatchError(f"row {mask_rows[_first(wrong)]}: loss_mask holds values not 0/1")
    if "routing" in table.column_names:
        _check_routing(table, lim, lengths_of["prompt_ids"] + completion_len)
    _check_teacher(table, lim, completion_len)


def _logprobs(
    table: pa.Table, name: str, completion_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(values, row of each value) of log-prob column `name`, checked: one entry per
    completion token, each finite and <= 0 (up to a low-precision sampler's rounding)."""
    values, rows, lengths = _lists(table, name)
    wrong = lengths != completion_len
    if wrong.any():
        row = _first(wrong)
        has = "is null" if lengths[row] < 0 else f"has {lengths[row]} entries"
        raise BadBatchError(
            f"row {row}: {name} {has} for {completion_len[row]} completion tokens; one "
            "entry per token is required"
        )
    wrong = ~np.isfinite(values) | (values > MAX_LOGPROB)
    if wrong.any():
        at = _first(wrong)
        raise BadBatchError(
            f"row {rows[at]}: {name} holds {values[at]}; a log-probability is finite and <= 0"
        )
    return values, rows


def _check_teacher(table: pa.Table, lim: BatchLimits, completion_len: np.ndarray) -> None:
    """The teacher's log-probs (`pipeline.rollouts`): present exactly in a run with a
    teacher, one finite log-probability per completion token, 0 off the loss mask."""
    present = "teacher_logprobs" in table.column_names
    if present != lim.teacher:
        raise BadBatchError(
            "has a teacher_logprobs column, but the run has no teacher (distill.teacher)"
            if present
            else "lacks the teacher_logprobs column; the run distils from a teacher "
            "(distill.teacher), so every batch carries the teacher's log-probs"
        )
    if not present:
        return
    got = table.schema.field("teacher_logprobs").type
    if got != TEACHER_TYPE:
        raise BadBatchError(f"column teacher_logprobs is {got}; expected {TEACHER_TYPE}")
    values, rows = _logprobs(table, "teacher_logprobs", completion_len)
    if "loss_mask" in table.column_names:
        arr = table.column("loss_mask").combine_chunks()
        # A null row's mask is all ones; the stored rows line up with the teacher's values.
        mask = np.ones(len(values), np.int64)
        lens = pc.fill_null(pc.list_value_length(arr), -1).to_numpy(zero_copy_only=False)
        flat = arr.flatten().to_numpy(zero_copy_only=False)
        starts = np.concatenate([[0], np.cumsum(completion_len)])
        at = 0
        for row in np.flatnonzero(lens >= 0):
            mask[starts[row] : starts[row + 1]] = flat[at : at + lens[row]]
            at += lens[row]
        wrong = (mask == 0) & (values != 0)
        if wrong.any():
            at = _first(wrong)
            raise BadBatchError(
                f"row {rows[at]}: teacher_logprobs holds {values[at]} on a token off the "
                "loss mask; allowed: 0 (context the policy did not sample)"
            )


def _check_routing(table: pa.Table, lim: BatchLimits, tokens: np.ndarray) -> None:
    """The routing column (`pipeline.rollouts`): a MoE model's, of its type, one entry per
    token, layer and pick, each an expert id or the not-recorded mark E."""
    if not lim.num_experts:
        raise BadBatchError("has a routing column, but the model is dense (model.num_experts 0)")
    want = pa.from_numpy_dtype(routing_dtype(lim.num_experts))
    got = table.schema.field("routing").type
    if not pa.types.is_list(got) or got.value_type != want:
        raise BadBatchError(
            f"column routing is {got}; expected a list of {want} for model.num_experts="
            f"{lim.num_experts}"
        )
    values, rows, lengths = _lists(table, "routing")
    wrong = lengths != tokens * lim.routing_width
    if wrong.any():
        row = _first(wrong)
        raise BadBatchError(
            f"row {row}: routing has {lengths[row]} entries for {tokens[row]} tokens; "
            f"expected tokens x layers x k = {tokens[row] * lim.routing_width}"
        )
    wrong = values > lim.num_experts
    if wrong.any():
        at = _first(wrong)
        raise BadBatchError(
            f"row {rows[at]}: routing holds expert {values[at]}; allowed: "
            f"0..{lim.num_experts - 1}, or {lim.num_experts} (not recorded)"
        )


def _check_values(table: pa.Table, lim: BatchLimits) -> None:
    reward = _column(table, "reward").astype(np.float64)
    lo, hi = lim.reward_range
    wrong = ~np.isfinite(reward) | (reward < lo) | (reward > hi)
    if wrong.any():
        row = _first(wrong)
        raise BadBatchError(f"row {row}: reward is {reward[row]}; allowed: finite, in [{lo}, {hi}]")


def _check_episodes(table: pa.Table) -> None:
    """The tool-episode columns (null on single-turn rows): turns >= 1 and set together
    with tool_calls, 0 <= tool_calls <= turns, and at most one error per call, each an
    ERROR_KINDS entry."""
    if "turns" not in table.column_names:
        return
    n = table.num_rows
    turns = table.column("turns")
    present = pc.is_valid(turns).to_numpy(zero_copy_only=False)
    t = pc.fill_null(turns, 0).to_numpy(zero_copy_only=False)
    if "tool_calls" in table.column_names:
        calls_col = table.column("tool_calls")
        calls_present = pc.is_valid(calls_col).to_numpy(zero_copy_only=False)
        calls = pc.fill_null(calls_col, 0).to_numpy(zero_copy_only=False)
    else:
        calls_present, calls = np.zeros(n, bool), np.zeros(n, np.int64)
    wrong = present != calls_present
    if wrong.any():
        raise BadBatchError(f"row {_first(wrong)}: turns and tool_calls must be set together")
    wrong = present & (t < 1)
    if wrong.any():
        raise BadBatchError(f"row {_first(wrong)}: turns is {t[_first(wrong)]}; allowed: >= 1")
    wrong = present & ((calls < 0) | (calls > t))
    if wrong.any():
        row = _first(wrong)
        raise BadBatchError(
            f"row {row}: tool_calls is {calls[row]} for {t[row]} turns; allowed: 0..turns"
        )
    if "tool_errors" not in table.column_names:
        return
    errors, error_rows, n_errors = _lists(table, "tool_errors")
    wrong = ~np.isin(errors.astype(object), ERROR_KINDS)
    if wrong.any():
        at = _first(wrong)
        raise BadBatchError(
            f"row {error_rows[at]}: tool_errors holds {errors[at]!r}; allowed: "
            + ", ".join(ERROR_KINDS)
        )
    wrong = n_errors > np.where(present, calls, 0)
    if wrong.any():
        row = _first(wrong)
        raise BadBatchError(
            f"row {row}: {n_errors[row]} tool_errors for {calls[row] if present[row] else 0} "
            "tool calls; allowed: at most one per call"
        )
