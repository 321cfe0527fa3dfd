"""Reading rows: every kind of bad content comes back as an error row, never raises."""

from __future__ import annotations

import gzip
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from beam_jobs.sources import (
    SourceError,
    detect_format,
    iter_lines,
    match_sources,
    read_csv,
    read_jsonl,
    read_parquet,
    read_source,
    source_name,
)


class CountingReader(io.BytesIO):
    """Records the largest chunk asked for, to show a long line is never read whole."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.max_request = 0

    def read(self, size=-1):
        self.max_request = max(self.max_request, size)
        return super().read(size)


def test_oversized_line_is_skipped_in_chunks():
    long_line = b"x" * (5 << 20)
    f = CountingReader(b"a\n" + long_line + b"\nb")
    out = list(iter_lines(f, max_bytes=100))
    assert [(line, size) for line, _, size in out] == [(b"a", 1), (None, len(long_line)), (b"b", 1)]
    assert out[1][1] == b"x" * 4096  # only a preview is kept
    assert f.max_request <= 1 << 20


def reasons(rows):
    return [(row, err[0] if err else None) for row, _, _, err in rows]


def test_jsonl_errors():
    data = (
        b'{"a": 1}\n'
        b"\n"  # blank: not a row
        b"[1]\n"
        b"{oops\n"
        b'{"a": "\xff"}\n'
        b'{"a": "\\udc80"}\n'  # lone surrogate escape
        b'{"a": "\\ud83d\\ude00"}\n' + b"[" * 3000 + b"\n"  # a valid surrogate pair is fine
    )
    assert reasons(read_jsonl(io.BytesIO(data), 10_000)) == [
        (0, None), (2, "invalid_json"), (3, "invalid_json"), (4, "invalid_utf8"),
        (5, "invalid_utf8"), (6, None), (7, "invalid_json"),
    ]  # fmt: skip


def test_csv_errors():
    data = (
        b'question,answer\nq1,a1\n"multi\nline",a2\nonly-one\nbad\xff,x\n'
        + b"y" * 300
        + b",z\nlast,row\n"
    )
    rows = list(read_csv(io.BytesIO(data), 200))
    assert reasons(rows) == [
        (0, None), (1, None), (2, "invalid_row"), (3, "invalid_utf8"), (4, "oversized"), (5, None),
    ]  # fmt: skip
    assert rows[1][1] == {"question": "multi\nline", "answer": "a2"}


def test_parquet_errors():
    good = pa.array([b"ok", b"\xff", b"also ok"], pa.binary())
    as_string = pa.Array.from_buffers(pa.string(), len(good), good.buffers())  # unvalidated
    buf = io.BytesIO()
    pq.write_table(pa.table({"q": as_string, "b": pa.array([b"1", b"\xfe", b"3"])}), buf)
    rows = list(read_parquet(io.BytesIO(buf.getvalue()), 1000))
    assert reasons(rows) == [(0, None), (1, "invalid_utf8"), (2, None)]
    assert rows[2][1] == {"q": "also ok", "b": "3"}
    assert reasons(read_parquet(io.BytesIO(b"PAR1 not parquet"), 1000)) == [(0, "unreadable_file")]


def test_formats_and_names(tmp_path):
    assert detect_format("a/b.JSONL.gz") == "jsonl"
    assert detect_format("x.pq") == "parquet"
    assert detect_format("x.txt", "csv") == "csv"
    with pytest.raises(SourceError, match="allowed extensions"):
        detect_format("x.txt")
    with pytest.raises(SourceError, match="allowed: auto, jsonl"):
        detect_format("x.jsonl", "xml")
    assert source_name("gs://b/eval/gsm8k_test.jsonl.gz") == "gsm8k_test"


def test_match_and_read_gzip(tmp_path):
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(b'{"question": "q", "answer": "#### 1"}\n')
    (tmp_path / "a.csv").write_text("question,answer\nq,#### 2\n")
    files = match_sources([str(tmp_path / "*")])
    assert [(f.rank, f.format) for f in files] == [(0, "csv"), (1, "jsonl")]
    rows = list(read_source(files[1], 1000))
    assert rows[0].fields == {"question": "q", "answer": "#### 1"} and rows[0].uid == (1 << 40)
    with pytest.raises(SourceError, match="matched no files"):
        match_sources([str(tmp_path / "none*")])
