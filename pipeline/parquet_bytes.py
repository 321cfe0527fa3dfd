"""Parquet tables to and from bytes (what the object store holds).

Reads use `pq.ParquetFile` on a `pa.BufferReader`, in the calling thread, rather than
`pq.read_table` on an `io.BytesIO`. `read_table` goes through the dataset scanner, whose
background threads can outlive the call. A process that exits soon afterwards then
aborts at shutdown with "terminate called without an active exception" (SIGABRT,
apache/arrow#33975, #34314). A job that has finished its work but exits -6 is retried for
nothing, or fails a check of its exit code.

Measured here with pyarrow 25.0.1, reading a run's problem set in a fresh process that
then exits:

| read | aborted |
|---|---|
| `read_table(io.BytesIO)` | 18/60 |
| `read_table(BufferReader)` | 3/100 |
| `ParquetFile(BufferReader).read(use_threads=False)` | 0/150 |

The tables are small (problem sets, rollout batches, eval samples), so one thread
decodes them in time.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq


def table_from_bytes(data: bytes) -> pa.Table:
    """The table in Parquet `data` (pyarrow's errors propagate for unreadable bytes)."""
    return pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)


def table_to_bytes(table: pa.Table) -> bytes:
    """`table` as zstd-compressed Parquet bytes."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()
