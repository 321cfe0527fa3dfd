"""Deterministic, memory-bounded Parquet shards.

Every output row goes to shard `stable_hash(sort key) % num_shards` and, within a shard,
rows are ordered by their sort key. So the bytes of each file depend only on the set of
rows, never on bundling, worker count or retries: re-running a job writes identical files.

Memory stays bounded whatever the data size: `SpillRuns` sorts at most `spill_rows` rows
at a time into a run file; `MergeShard` streams a k-way merge of a shard's runs. This is
an external sort on the staging filesystem, so the runner's shuffle only ever carries
file names.
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms.window import GlobalWindows

from beam_jobs.text import hash64

SORT_COLUMN = "_sort"  # in run files only
ROW_GROUP_ROWS = 8192
# Run files use small row groups: a k-way merge holds one decoded row group per run.
RUN_ROW_GROUP_ROWS = 512
COMPRESSION = "zstd"

_PROBLEM_FIELDS = [
    pa.field("problem_id", pa.string(), nullable=False),
    pa.field("task", pa.string(), nullable=False),
    pa.field("prompt", pa.string(), nullable=False),
    pa.field("answer", pa.string(), nullable=False),
    pa.field("meta", pa.string(), nullable=False),  # JSON object, sorted keys
]
_PROVENANCE = [
    pa.field("source", pa.string(), nullable=False),
    pa.field("row", pa.int64(), nullable=False),
]
PROBLEM_SCHEMA = pa.schema(
    _PROBLEM_FIELDS
    + [
        pa.field("problem", pa.string(), nullable=False),
        pa.field("schema", pa.string(), nullable=False),
        pa.field("pass_rate", pa.float64()),
    ]
    + _PROVENANCE
)
DEAD_LETTER_SCHEMA = pa.schema(
    _PROVENANCE
    + [
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string(), nullable=False),
        pa.field("raw", pa.string(), nullable=False),
    ]
)
REMOVED_SCHEMA = pa.schema(
    _PROVENANCE
    + [
        pa.field("problem_id", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("problem", pa.string(), nullable=False),
        pa.field("step", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("duplicate_of_source", pa.string()),
        pa.field("duplicate_of_row", pa.int64()),
        pa.field("eval_sets", pa.string()),
        pa.field("eval_problem_id", pa.string()),
        pa.field("pass_rate", pa.float64()),
    ]
)
OUTPUTS: dict[str, pa.Schema] = {
    "train": PROBLEM_SCHEMA,
    "validation": PROBLEM_SCHEMA,
    "dead_letter": DEAD_LETTER_SCHEMA,
    "removed": REMOVED_SCHEMA,
}


def shard_path(root: str, output: str, shard: int, num_shards: int) -> str:
    return FileSystems.join(root, output, f"part-{shard:05d}-of-{num_shards:05d}.parquet")


def num_shards_for(rows: int, rows_per_shard: int) -> int:
    return max(1, -(-rows // rows_per_shard))


def shard_of(sort_key: str, num_shards: int) -> int:
    return hash64(sort_key) % num_shards


class _ShardWriter:
    """Row groups of `group_rows` rows, streamed to `path` (an empty file is valid)."""

    def __init__(self, path: str, schema: pa.Schema, group_rows: int = ROW_GROUP_ROWS) -> None:
        self.schema = schema
        self.group_rows = group_rows
        self.rows = 0
        self._file = FileSystems.create(path)
        self._writer = pq.ParquetWriter(self._file, schema, compression=COMPRESSION)
        self._chunk: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self._chunk.append(row)
        if len(self._chunk) == self.group_rows:
            self._flush()

    def _flush(self) -> None:
        self._writer.write_table(pa.Table.from_pylist(self._chunk, schema=self.schema))
        self.rows += len(self._chunk)
        self._chunk = []

    def close(self) -> int:
        if self._chunk or self.rows == 0:
            self._flush()
        self._writer.close()
        self._file.close()
        return self.rows


def _write_table(
    path: str, rows: list[dict[str, Any]], schema: pa.Schema, group_rows: int = ROW_GROUP_ROWS
) -> None:
    writer = _ShardWriter(path, schema, group_rows)
    for row in rows:
        writer.add(row)
    writer.close()


def write_empty(path: str, schema: pa.Schema) -> None:
    _write_table(path, [], schema)


class SpillRuns(beam.DoFn):
    """(output, row) -> sorted run files, at most `spill_rows` rows in memory at once.

    Emits ((output, shard), run path). `row` must hold SORT_COLUMN.
    """

    def __init__(self, runs_dir: str, spill_rows: int) -> None:
        self.runs_dir = runs_dir
        self.spill_rows = spill_rows

    def setup(self) -> None:
        self._buffers: dict[tuple[str, int], list[dict[str, Any]]] = {}
        self._held = 0

    def start_bundle(self) -> None:
        self._buffers, self._held = {}, 0

    def process(self, element: tuple[str, dict[str, Any]], shard_counts: dict[str, int]):
        output, row = element
        key = (output, shard_of(row[SORT_COLUMN], shard_counts[output]))
        self._buffers.setdefault(key, []).append(row)
        self._held += 1
        if self._held >= self.spill_rows:
            yield from self._flush()

    def finish_bundle(self):
        for item in self._flush():
            yield GlobalWindows.windowed_value(item)

    def _flush(self) -> Iterator[tuple[tuple[str, int], str]]:
        for (output, shard), rows in sorted(self._buffers.items()):
            rows.sort(key=lambda r: r[SORT_COLUMN])
            schema = OUTPUTS[output].append(pa.field(SORT_COLUMN, pa.string(), nullable=False))
            path = FileSystems.join(
                self.runs_dir, output, f"{shard:05d}", f"run-{uuid.uuid4().hex}.parquet"
            )
            _write_table(path, rows, schema, RUN_ROW_GROUP_ROWS)
            yield (output, shard), path
        self._buffers, self._held = {}, 0


def _iter_run(path: str) -> Iterator[dict[str, Any]]:
    with FileSystems.open(path) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=256):  # k runs x 256 rows held
            yield from batch.to_pylist()


class MergeShard(beam.DoFn):
    """((output, shard), run paths) -> the final shard file, by a streaming k-way merge."""

    def __init__(self, root: str) -> None:
        self.root = root

    def process(self, element: tuple[tuple[str, int], Iterable[str]], shard_counts: dict[str, int]):
        (output, shard), paths = element
        schema = OUTPUTS[output]
        path = shard_path(self.root, output, shard, shard_counts[output])
        merged = heapq.merge(
            *(_iter_run(p) for p in sorted(set(paths))), key=lambda r: r[SORT_COLUMN]
        )
        writer = _ShardWriter(path, schema)
        for row in merged:
            del row[SORT_COLUMN]
            writer.add(row)
        rows = writer.close()
        yield output, shard, rows


class WriteShards(beam.PTransform):
    """PCollection[(output, row)] -> PCollection[(output, shard, rows)], one per written shard.

    Files land at `root/<output>/part-SSSSS-of-NNNNN.parquet`; `shard_counts` is a side
    input (AsDict) output -> number of shards. Shards that receive no row are not written
    here: `missing_shards` lists them so the caller writes them empty.
    """

    def __init__(self, root: str, shard_counts: Any, spill_rows: int = 20000) -> None:
        super().__init__()
        self.root = root
        self.shard_counts = shard_counts
        self.spill_rows = spill_rows

    def expand(self, rows):
        runs_dir = FileSystems.join(self.root, "_runs")
        return (
            rows
            | "SpillSortedRuns"
            >> beam.ParDo(SpillRuns(runs_dir, self.spill_rows), self.shard_counts)
            | "GroupRunsByShard" >> beam.GroupByKey()
            | "MergeRuns" >> beam.ParDo(MergeShard(self.root), self.shard_counts)
        )


def missing_shards(
    written: Iterable[tuple[str, int, int]], shard_counts: dict[str, int]
) -> list[tuple[str, int]]:
    done = {(o, s) for o, s, _ in written}
    return [(o, s) for o, n in sorted(shard_counts.items()) for s in range(n) if (o, s) not in done]
