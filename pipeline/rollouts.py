"""The rollout-batch format: one immutable Parquet object per batch index.

A batch holds G samples for each of `prompts_per_batch` prompts, with everything the
trainer needs (token ids, behaviour log-probs, rewards) and the provenance (policy
version, worker id). Rows are ordered by (prompt_pos, sample_index), so groups are
contiguous and of size G.

Learning to judge (`RolloutConfig.judge_fraction`) adds *judge groups* after the solve
groups (each contiguous and of size G, ordered by judge slot): `kind` is "judge" (else
"solve"), `prompt_ids` the judged problem's prompt, `completion_ids` the judged solution
(ending in one EOS, `pipeline.tasks.judge`) + the verification suffix + the sampled verdict (+ EOS), and `loss_mask` is 0
on the solution and suffix tokens (context the policy did not sample here) and 1 on the
verdict tokens; `behaviour_logprobs` are 0 where the mask is 0. Both columns are optional:
a batch written before them (or a row with a null mask) reads as all "solve" with an
all-ones mask.

Tool episodes (`environment.name` other than "none", `tpu_jobs.generate.episodes`): a row's
`completion_ids` hold all its turns and the observations appended between them
(`pipeline.tool_calls`); `loss_mask` is 1 on sampled tokens and 0 on observation tokens,
whose `behaviour_logprobs` are 0. `turns` is the number of generated turns, `tool_calls`
the turns that ended in a call (malformed ones included), `tool_errors` one
`pipeline.tool_calls.ERROR_KINDS` entry per failed call, in call order. All three are null
on single-turn rows and in batches written before them.

Routing replay (MoE models, `trainer.routing_replay`): `routing` holds, per row, the
experts the sampler's routers chose for every token of prompt + completion, token-major
and flattened ([tokens, layers, k] -> one list), in the smallest unsigned type that holds
the ids 0..E-1 and the not-recorded mark E (`routing_dtype`: uint8 up to 255 experts). A
token the sampler never ran (a completion's last token: nothing was sampled after it) is
all E, as is a row made without recording; the trainer routes those itself. The column
exists only when a batch carries routing (None: absent), so a dense run's batch bytes are
those of a batch without it.

On-policy distillation (`distill.teacher`, `pipeline.distill`): `teacher_logprobs` holds,
per completion token, the pinned teacher's log-prob of that token given the row's prompt
and the tokens before it (at the sampler's temperature, as `behaviour_logprobs`), 0 where
the loss mask is 0 (context the policy did not sample). Like `routing`, the column exists
only in a run with a teacher.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.layout import ROLLOUTS_PREFIX
from pipeline.parquet_bytes import table_from_bytes, table_to_bytes

SCHEMA = pa.schema(
    [
        ("batch_index", pa.int64()),
        ("prompt_pos", pa.int32()),
        ("prompt_id", pa.string()),
        ("task", pa.string()),
        ("sample_index", pa.int32()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("completion", pa.string()),
        ("finished", pa.bool_()),
        ("reward", pa.float32()),
        ("policy_version", pa.int64()),
        ("worker_id", pa.string()),
    ]
)
# Columns added later: absent in older batches (see `from_parquet_bytes` for the defaults).
OPTIONAL_FIELDS = [
    ("kind", pa.string()),  # "solve" | "judge"
    ("loss_mask", pa.list_(pa.int8())),  # per completion token; null: all ones
    ("turns", pa.int32()),  # generated turns of a tool episode; null: single turn
    ("tool_calls", pa.int32()),  # turns that ended in a tool call; null: none
    ("tool_errors", pa.list_(pa.string())),  # an ERROR_KINDS entry per failed call
]
# The per-row columns of tool episodes (null on single-turn rows).
EPISODE_FIELDS = ("turns", "tool_calls", "tool_errors")
FULL_SCHEMA = pa.schema([*SCHEMA, *OPTIONAL_FIELDS])
# The teacher's log-probs (on-policy distillation); written only when present.
TEACHER_TYPE = pa.list_(pa.float32())
# The routing column's element types (numpy -> Arrow); written only when present.
ROUTING_TYPES = {np.dtype(np.uint8): pa.uint8(), np.dtype(np.uint16): pa.uint16()}


def routing_dtype(num_experts: int) -> np.dtype:
    """The element type of a routing record of `num_experts` experts: the smallest
    unsigned type holding ids 0..E-1 and the not-recorded mark E."""
    return np.dtype(np.uint8 if num_experts <= np.iinfo(np.uint8).max else np.uint16)


KINDS = ("solve", "judge")


@dataclass
class RolloutBatch:
    """Column arrays of one batch (ragged token lists kept as Python lists)."""

    batch_index: int
    prompt_pos: np.ndarray
    prompt_id: list[str]
    task: list[str]
    sample_index: np.ndarray
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]
    completion: list[str]
    finished: np.ndarray
    reward: np.ndarray
    policy_version: int
    worker_id: str
    kind: list[str] | None = None  # None: every row is "solve"
    loss_mask: list[list[int] | None] | None = None  # None (or a None row): all ones
    turns: list[int | None] | None = None  # None (or a None row): a single-turn row
    tool_calls: list[int | None] | None = None
    tool_errors: list[list[str] | None] | None = None
    # Routing replay: per row, [prompt + completion tokens, layers, k] flattened (module
    # docstring); None: not recorded (every dense run).
    routing: list[np.ndarray] | None = None
    # On-policy distillation: the teacher's log-prob of every completion token (module
    # docstring); None: the run has no teacher.
    teacher_logprobs: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.prompt_id)

    def kinds(self) -> list[str]:
        """Each row's kind ("solve" or "judge")."""
        return list(self.kind) if self.kind is not None else ["solve"] * len(self)

    def is_judge(self) -> np.ndarray:
        """[rows] bool: the judge rows."""
        return np.asarray([k == "judge" for k in self.kinds()], bool)

    def token_mask(self, row: int) -> list[int]:
        """The loss mask of one row's completion tokens (all ones when none is stored)."""
        m = None if self.loss_mask is None else self.loss_mask[row]
        return [1] * len(self.completion_ids[row]) if m is None else list(m)

    def is_episode(self) -> np.ndarray:
        """[rows] bool: the rows that are tool episodes (`turns` not null)."""
        if self.turns is None:
            return np.zeros(len(self), bool)
        return np.asarray([t is not None for t in self.turns], bool)

    def num_tokens(self) -> int:
        return int(sum(len(c) for c in self.completion_ids))


def batch_key(index: int) -> str:
    return f"{ROLLOUTS_PREFIX}/b{index:08d}.parquet"


def to_parquet_bytes(batch: RolloutBatch) -> bytes:
    n = len(batch)
    bad = sorted(set(batch.kinds()) - set(KINDS))
    if bad:
        raise ValueError(f"rollout batch has rows of kind {bad}; allowed: {', '.join(KINDS)}")
    if batch.loss_mask is not None:
        for i, m in enumerate(batch.loss_mask):
            if m is not None and len(m) != len(batch.completion_ids[i]):
                raise ValueError(
                    f"row {i}: loss_mask has {len(m)} entries for "
                    f"{len(batch.completion_ids[i])} completion tokens; they must match"
                )
    episode = {}
    for name in EPISODE_FIELDS:
        values = getattr(batch, name)
        if values is not None and len(values) != n:
            raise ValueError(f"rollout batch has {len(values)} {name} values for {n} rows")
        episode[name] = [None] * n if values is None else list(values)
    columns, schema = {}, FULL_SCHEMA
    if batch.routing is not None:
        columns["routing"] = _routing_column(batch)
        schema = schema.append(pa.field("routing", columns["routing"].type))
    if batch.teacher_logprobs is not None:
        columns["teacher_logprobs"] = _teacher_column(batch)
        schema = schema.append(pa.field("teacher_logprobs", TEACHER_TYPE))
    table = pa.table(
        {
            "batch_index": np.full(n, batch.batch_index, np.int64),
            "prompt_pos": np.asarray(batch.prompt_pos, np.int32),
            "prompt_id": batch.prompt_id,
            "task": batch.task,
            "sample_index": np.asarray(batch.sample_index, np.int32),
            "prompt_ids": batch.prompt_ids,
            "completion_ids": batch.completion_ids,
            "behaviour_logprobs": batch.behaviour_logprobs,
            "completion": batch.completion,
            "finished": np.asarray(batch.finished, bool),
            "reward": np.asarray(batch.reward, np.float32),
            "policy_version": np.full(n, batch.policy_version, np.int64),
            "worker_id": [batch.worker_id] * n,
            "kind": batch.kinds(),
            "loss_mask": (
                [None] * n
                if batch.loss_mask is None
                else [None if m is None else list(m) for m in batch.loss_mask]
            ),
            **episode,
            **columns,
        },
        schema=schema,
    )
    return table_to_bytes(table)


def _routing_type(routing: list[np.ndarray]) -> np.dtype:
    kinds = {np.asarray(r).dtype for r in routing}
    if len(kinds) != 1 or not kinds <= set(ROUTING_TYPES):
        raise ValueError(
            f"routing rows are of types {sorted(map(str, kinds))}; allowed: one of "
            + ", ".join(str(t) for t in ROUTING_TYPES)
        )
    return kinds.pop()


def _routing_column(batch: RolloutBatch) -> pa.Array:
    if len(batch.routing) != len(batch):
        raise ValueError(f"rollout batch has {len(batch.routing)} routing rows for {len(batch)}")
    dtype = _routing_type(batch.routing)
    flat = [np.asarray(r).reshape(-1) for r in batch.routing]
    for i, r in enumerate(flat):
        tokens = len(batch.prompt_ids[i]) + len(batch.completion_ids[i])
        if r.size % tokens:
            raise ValueError(
                f"row {i}: routing has {r.size} entries for {tokens} tokens; allowed: "
                "tokens x layers x k"
            )
    offsets = np.concatenate([[0], np.cumsum([r.size for r in flat])]).astype(np.int32)
    values = np.concatenate(flat) if flat else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, ROUTING_TYPES[dtype]))


def _teacher_column(batch: RolloutBatch) -> list[list[float]]:
    rows = batch.teacher_logprobs
    if len(rows) != len(batch):
        raise ValueError(f"rollout batch has {len(rows)} teacher_logprobs rows for {len(batch)}")
    for i, r in enumerate(rows):
        if len(r) != len(batch.completion_ids[i]):
            raise ValueError(
                f"row {i}: teacher_logprobs has {len(r)} entries for "
                f"{len(batch.completion_ids[i])} completion tokens; they must match"
            )
    return [list(r) for r in rows]


def from_parquet_bytes(data: bytes) -> RolloutBatch:
    """A batch from its Parquet bytes, unchecked (the trainer reads through
    `pipeline.batch_checks.read_checked`)."""
    return batch_from_table(table_from_bytes(data))


def batch_from_table(table: pa.Table) -> RolloutBatch:
    missing = set(SCHEMA.names) - set(table.column_names)
    if missing:
        raise ValueError(f"rollout batch lacks columns {sorted(missing)}; schema: {SCHEMA.names}")
    # The routing column is read as arrays (`_routing_rows`), not as Python lists.
    cols = table.drop_columns([n for n in ("routing",) if n in table.column_names]).to_pydict()
    if not cols["batch_index"]:
        raise ValueError("rollout batch is empty")
    return RolloutBatch(
        batch_index=int(cols["batch_index"][0]),
        prompt_pos=np.asarray(cols["prompt_pos"], np.int32),
        prompt_id=cols["prompt_id"],
        task=cols["task"],
        sample_index=np.asarray(cols["sample_index"], np.int32),
        prompt_ids=cols["prompt_ids"],
        completion_ids=cols["completion_ids"],
        behaviour_logprobs=cols["behaviour_logprobs"],
        completion=cols["completion"],
        finished=np.asarray(cols["finished"], bool),
        reward=np.asarray(cols["reward"], np.float32),
        policy_version=int(cols["policy_version"][0]),
        worker_id=cols["worker_id"][0],
        kind=cols.get("kind"),
        loss_mask=cols.get("loss_mask"),
        **{name: cols.get(name) for name in EPISODE_FIELDS},
        routing=_routing_rows(table),
        teacher_logprobs=cols.get("teacher_logprobs"),
    )


def _routing_rows(table: pa.Table) -> list[np.ndarray] | None:
    """The routing column as one flat array per row (zero-copy slices), or None."""
    if "routing" not in table.column_names:
        return None
    column = table.column("routing").combine_chunks()
    values = column.values.to_numpy(zero_copy_only=False)
    offsets = column.offsets.to_numpy()
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(column))]


def required_version(index: int, publish_every: int, max_staleness: int) -> int:
    """The policy version batch `index` is generated from.

    The trainer consumes batch t at step t, holding version t // publish_every; a batch
    made from version v is `t // publish_every - v` versions stale. Pinning each batch
    to the oldest version the staleness bound allows makes the whole run reproducible
    (a batch depends only on its index and that version) while still letting workers
    run `max_staleness` versions ahead of the trainer.
    """
    return max(0, index // publish_every - max_staleness)
