"""The rollout-batch format: one immutable Parquet object per batch index.

A batch holds G samples for each of `prompts_per_batch` prompts, with everything the
trainer needs (token ids, behaviour log-probs, rewards) and the provenance (policy
version, worker id). Rows are ordered by (prompt_pos, sample_index), so groups are
contiguous and of size G.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

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

    def __len__(self) -> int:
        return len(self.prompt_id)

    def num_tokens(self) -> int:
        return int(sum(len(c) for c in self.completion_ids))


def batch_key(index: int) -> str:
    return f"rollouts/b{index:08d}.parquet"


def to_parquet_bytes(batch: RolloutBatch) -> bytes:
    n = len(batch)
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
        },
        schema=SCHEMA,
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def from_parquet_bytes(data: bytes) -> RolloutBatch:
    table = pq.read_table(io.BytesIO(data))
    missing = set(SCHEMA.names) - set(table.column_names)
    if missing:
        raise ValueError(f"rollout batch lacks columns {sorted(missing)}; schema: {SCHEMA.names}")
    cols = table.to_pydict()
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
    )


def required_version(index: int, publish_every: int, max_staleness: int) -> int:
    """The policy version batch `index` is generated from.

    The trainer consumes batch t at step t, holding version t // publish_every; a batch
    made from version v is `t // publish_every - v` versions stale. Pinning each batch
    to the oldest version the staleness bound allows makes the whole run reproducible
    (a batch depends only on its index and that version) while still letting workers
    run `max_staleness` versions ahead of the trainer.
    """
    return max(0, index // publish_every - max_staleness)
