"""Reading source files row by row: JSONL, CSV and Parquet, local or gs://.

`iter_rows` never raises on bad content: a row that cannot be decoded comes back with
an error (reason, detail) instead of fields, so the caller can dead-letter it. Memory
stays bounded per row: an oversized JSONL line is skipped in chunks, never held whole.
I/O errors do raise, so the runner retries the bundle instead of losing a file.
"""

from __future__ import annotations

import bz2
import contextlib
import csv
import gzip
import io
import json
import os
import posixpath
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

# Reasons a row can fail before schema mapping (see docs/curation.md for the full list).
INVALID_UTF8 = "invalid_utf8"
INVALID_JSON = "invalid_json"
INVALID_ROW = "invalid_row"
OVERSIZED = "oversized"
UNREADABLE_FILE = "unreadable_file"

PREVIEW_BYTES = 4096  # what a dead-letter row keeps of an oversized row
_CHUNK = 1 << 20

FORMATS = ("jsonl", "csv", "parquet")
EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}
COMPRESSION_SUFFIXES = (".gz", ".bz2")

# uid = file_rank << ROW_BITS | row: a 63-bit id whose order is (file, row) order.
ROW_BITS = 40
MAX_FILES = 1 << (63 - ROW_BITS)


class SourceError(ValueError):
    """An input argument names nothing readable (no files, unknown format)."""


@dataclass(frozen=True)
class SourceFile:
    """One input file; `rank` is its place in the sorted list of all inputs."""

    rank: int
    path: str
    format: str
    size: int = 0
    version: int = 0  # local mtime (ns) or GCS generation


@dataclass(frozen=True)
class RawRow:
    """A row as read: `fields` when it decoded, else `error` = (reason, detail)."""

    uid: int
    source: str
    row: int
    fields: dict[str, Any] | None
    raw: str
    error: tuple[str, str] | None = None


def make_uid(rank: int, row: int) -> int:
    if not 0 <= row < (1 << ROW_BITS):
        raise SourceError(f"row {row} is out of range; a file may hold at most 2^{ROW_BITS} rows")
    return (rank << ROW_BITS) | row


def split_uid(uid: int) -> tuple[int, int]:
    return uid >> ROW_BITS, uid & ((1 << ROW_BITS) - 1)


def detect_format(path: str, fmt: str = "auto") -> str:
    if fmt != "auto":
        if fmt not in FORMATS:
            raise SourceError(f"--format {fmt!r} is invalid; allowed: auto, {', '.join(FORMATS)}")
        return fmt
    name = posixpath.basename(path).lower()
    for suffix in COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    ext = os.path.splitext(name)[1]
    if ext not in EXTENSIONS:
        raise SourceError(
            f"cannot tell the format of {path!r} from its extension {ext!r}; allowed "
            f"extensions: {', '.join(sorted(EXTENSIONS))} (optionally compressed: "
            f"{', '.join(COMPRESSION_SUFFIXES)}), or pass --format {'|'.join(FORMATS)}"
        )
    return EXTENSIONS[ext]


def source_name(path: str) -> str:
    """A short name for a file: its basename without format/compression extensions."""
    name = posixpath.basename(path)
    for suffix in COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    stem, ext = os.path.splitext(name)
    return stem if ext.lower() in EXTENSIONS else name


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _preview(data: bytes) -> str:
    return data[:PREVIEW_BYTES].decode("utf-8", "backslashreplace")


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ----------------------------------------------------------------------------- JSONL


def iter_lines(f: BinaryIO, max_bytes: int) -> Iterator[tuple[bytes | None, bytes, int]]:
    """Lines of `f` without their newline: (line, b"", size), or (None, preview, size)
    for a line longer than `max_bytes`, which is never held in memory whole."""
    buf = bytearray()
    skipping = False  # inside an oversized line
    preview = b""
    size = 0
    while True:
        data = f.read(_CHUNK)
        if not data:
            break
        start = 0
        while True:
            nl = data.find(b"\n", start)
            piece = data[start:] if nl < 0 else data[start:nl]
            size += len(piece)
            if not skipping:
                buf += piece
                if len(buf) > max_bytes:
                    skipping, preview = True, bytes(buf[:PREVIEW_BYTES])
                    buf.clear()
            if nl < 0:
                break
            yield (None, preview, size) if skipping else (bytes(buf), b"", size)
            buf.clear()
            skipping, size, start = False, 0, nl + 1
    if skipping:
        yield None, preview, size
    elif buf:
        yield bytes(buf), b"", size


def read_jsonl(f: BinaryIO, max_bytes: int) -> Iterator[tuple[int, Any, str, tuple | None]]:
    for row, (line, preview, size) in enumerate(iter_lines(f, max_bytes)):
        if line is None:
            yield row, None, _preview(preview), (OVERSIZED, f"{size} bytes > limit {max_bytes}")
            continue
        line = line.rstrip(b"\r")
        if not line.strip():
            continue  # blank lines are not rows
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            yield row, None, _preview(line), (INVALID_UTF8, str(err))
            continue
        try:
            fields = json.loads(text)
        except (ValueError, RecursionError) as err:
            yield row, None, text, (INVALID_JSON, str(err) or type(err).__name__)
            continue
        if not isinstance(fields, dict):
            yield row, None, text, (INVALID_JSON, f"a JSON {type(fields).__name__}, not an object")
            continue
        if _SURROGATE_ESCAPE.search(text) and _has_surrogates(
            json.dumps(fields, ensure_ascii=False)
        ):
            yield row, None, text, (INVALID_UTF8, "a \\u escape of a lone surrogate")
            continue
        yield row, fields, text, None


# ------------------------------------------------------------------------------- CSV


def read_csv(f: BinaryIO, max_bytes: int) -> Iterator[tuple[int, Any, str, tuple | None]]:
    csv.field_size_limit(max(max_bytes + 1, 1 << 17))
    text = io.TextIOWrapper(f, encoding="utf-8", errors="surrogateescape", newline="")
    reader = csv.reader(text)
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as err:
        yield 0, None, "", (UNREADABLE_FILE, f"bad CSV header: {err}")
        return
    row = -1
    while True:
        row += 1
        try:
            record = next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            reason = OVERSIZED if "field limit" in str(err) else INVALID_ROW
            yield row, None, "", (reason, f"CSV: {err}")
            continue
        raw = json.dumps(record, ensure_ascii=False)
        if _has_surrogates(raw):
            bad = raw.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            yield row, None, bad[:PREVIEW_BYTES], (INVALID_UTF8, "bytes that are not UTF-8")
            continue
        if len(raw.encode()) > max_bytes:
            yield row, None, raw[:PREVIEW_BYTES], (OVERSIZED, f"> limit {max_bytes} bytes")
            continue
        if len(record) != len(header):
            yield row, None, raw, (INVALID_ROW, f"{len(record)} fields, header has {len(header)}")
            continue
        yield row, dict(zip(header, record, strict=True)), raw, None


# --------------------------------------------------------------------------- Parquet


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def _batch_rows(batch: Any) -> list[Any]:
    """Rows of a record batch; a row whose string column is not UTF-8 becomes the error."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        out: list[Any] = []
        for i in range(batch.num_rows):
            try:
                out.extend(batch.slice(i, 1).to_pylist())
            except UnicodeDecodeError as err:
                out.append(err)
        return out


def read_parquet(f: BinaryIO, max_bytes: int) -> Iterator[tuple[int, Any, str, tuple | None]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        batches = pq.ParquetFile(f).iter_batches(batch_size=512)
        for batch in batches:
            for fields in _batch_rows(batch):
                if isinstance(fields, UnicodeDecodeError):
                    yield row, None, "", (INVALID_UTF8, f"Parquet string column: {fields}")
                    row += 1
                    continue
                raw = json.dumps(fields, ensure_ascii=False, default=_jsonable, sort_keys=True)
                error = None
                for key, value in fields.items():
                    if isinstance(value, bytes):
                        try:
                            fields[key] = value.decode("utf-8")
                        except UnicodeDecodeError as err:
                            error = (INVALID_UTF8, f"field {key!r}: {err}")
                            break
                if error is None and len(raw.encode()) > max_bytes:
                    error = (OVERSIZED, f"> limit {max_bytes} bytes")
                    raw = raw[:PREVIEW_BYTES]
                yield row, (None if error else fields), raw, error
                row += 1
    except pa.ArrowException as err:  # corrupt content; plain I/O errors propagate (retry)
        yield row, None, "", (UNREADABLE_FILE, f"Parquet: {err}")


READERS = {"jsonl": read_jsonl, "csv": read_csv, "parquet": read_parquet}


def iter_rows(f: BinaryIO, src: SourceFile, max_bytes: int) -> Iterator[RawRow]:
    """Every row of one open file as a RawRow (bad rows carry their error)."""
    for row, fields, raw, error in READERS[src.format](f, max_bytes):
        yield RawRow(make_uid(src.rank, row), src.path, row, fields, raw, error)


def _decompress(f: BinaryIO, path: str) -> BinaryIO:
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=f)  # type: ignore[return-value]
    if path.endswith(".bz2"):
        return bz2.BZ2File(f)  # type: ignore[return-value]
    return f


@contextlib.contextmanager
def open_source(path: str) -> Iterator[BinaryIO]:
    """A local or remote (gs://) file as a binary stream (.gz/.bz2 decompressed).

    Remote objects are streamed to a local temp file through the project's ObjectStore
    (its retries, and the GCS emulator in tests), then read from disk.
    """
    from pipeline.storage import local_path, open_parent

    file = local_path(path)
    if file is not None:
        with open(file, "rb") as raw:
            yield _decompress(raw, path)
        return
    store, key = open_parent(path)
    with tempfile.TemporaryDirectory(prefix="rlax-src-") as tmp:
        local = os.path.join(tmp, "object")
        store.read_to_file(key, local)
        with open(local, "rb") as raw:
            yield _decompress(raw, path)


def read_source(src: SourceFile, max_bytes: int) -> Iterator[RawRow]:
    with open_source(src.path) as f:
        yield from iter_rows(f, src, max_bytes)


def _match_one(pattern: str) -> dict[str, tuple[int, int]]:
    """path -> (size, version) for one glob; version is the local mtime in ns or the GCS
    object generation, so a rewritten input changes the job's fingerprint."""
    from pipeline.storage import glob

    try:
        return {m.url: (m.size, m.version) for m in glob(pattern)}
    except ValueError as err:  # a malformed URL: the job's own error, which main() reports
        raise SourceError(str(err)) from None


def match_sources(
    patterns: list[str], fmt: str = "auto", what: str = "--input"
) -> list[SourceFile]:
    """Expand globs (local or gs://), sorted by path, each pattern required to match."""
    found: dict[str, tuple[int, int]] = {}
    for pattern in patterns:
        files = _match_one(pattern)
        if not files:
            raise SourceError(f"{what} {pattern!r} matched no files")
        found.update(files)
    paths = sorted(found)
    if len(paths) >= MAX_FILES:
        raise SourceError(f"{what} matched {len(paths)} files; at most {MAX_FILES - 1} allowed")
    return [
        SourceFile(i, p, detect_format(p, fmt), found[p][0], found[p][1])
        for i, p in enumerate(paths)
    ]
