"""The curation steps as composite Beam PTransforms.

The job reads its inputs twice (see docs/curation.md):

* pass 1 computes a compact key per problem (`Fingerprint`: uid, id, exact-dedup hash,
  LSH band hashes, eval-set hit) and, from the keys alone, what each step removes
  (`ExactDedup`, `NearDedup`, `Decontaminate`, `DifficultyBand`, merged by `CombineDrops`);
* pass 2 (`Route`) re-reads the rows and sends each to train / validation / removed /
  dead_letter, which `shards.WriteShards` writes as deterministic Parquet shards.

Full rows therefore never sit in a shuffle or a side input, and the shuffles carry
packed NumPy arrays (16 bytes per entry, 11 entries per row), so memory grows by a few
hundred bytes per row plus the removed rows, never with the text.

Steps are decided on the full key set and a row is attributed to the FIRST step that
removes it, which gives the same counts as applying them one after another: an exact
duplicate has the signature of its survivor, so it adds no near-duplicate edge that the
survivor lacks, and the survivor of a group is its smallest uid either way.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.transforms.window import GlobalWindows

from beam_jobs import minhash, schemas
from beam_jobs.decontam import Hit, NgramIndex
from beam_jobs.shards import SORT_COLUMN
from beam_jobs.sources import RawRow, SourceFile, read_source, split_uid
from beam_jobs.text import dedup_text, hash64

DEAD_LETTER = "dead_letter"
PROBLEMS = "problems"
STATS = "stats"
ROWS = "rows"  # Route's (output, row) pairs

# Steps in the order they apply; a row removed by several is counted by the first.
STEPS = ("exact_dedup", "near_dedup", "decontaminate", "difficulty")
SPLITS = ("train", "validation")


# ------------------------------------------------------------------------ records


@dataclass(frozen=True)
class Key:
    """What pass 1 keeps of a problem: about a hundred bytes, no text."""

    uid: int
    problem_id: str
    dedup: int  # hash of the dedup form of the problem text
    bands: bytes  # LSH band keys, uint64 each
    hit: Hit | None  # evaluation sets sharing an n-gram with it


@dataclass(frozen=True)
class Drop:
    """Why a step removes a row; `ref` is the uid of the duplicate that survives."""

    step: str
    reason: str
    ref: int = -1
    eval_sets: str = ""
    eval_problem_id: str = ""
    pass_rate: float | None = None


def parse_row(raw: RawRow, schema: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(problem record, None) or (None, dead-letter record); never raises on bad data."""
    if raw.error is None:
        result = schemas.align(raw.fields or {}, schema)
    else:
        result = schemas.Rejected(*raw.error)
    if isinstance(result, schemas.Rejected):
        return None, {
            "uid": raw.uid,
            "source": raw.source,
            "row": raw.row,
            "reason": result.reason,
            "detail": result.detail,
            "raw": raw.raw,
        }
    return {
        "uid": raw.uid,
        "source": raw.source,
        "row": raw.row,
        "problem_id": result.problem_id,
        "task": result.task,
        "problem": result.problem,
        "prompt": result.prompt,
        "answer": result.answer,
        "meta": result.meta,
        "schema": result.schema,
    }, None


def assign_split(problem_id: str, val_fraction: float, seed: int) -> str:
    """Deterministic split from a hash of the id: the same problem always lands alike."""
    u = hash64(f"{seed}\x00{problem_id}") / float(1 << 63)
    return "validation" if u < val_fraction else "train"


# ------------------------------------------------------------------- read & parse


class ReadRows(beam.PTransform):
    """PCollection[SourceFile] -> PCollection[RawRow]. Files are spread over workers
    first; each is read as a stream (bad rows come out with their error, not raised)."""

    def __init__(self, max_row_bytes: int) -> None:
        super().__init__()
        self.max_row_bytes = max_row_bytes

    def expand(self, files):
        return (
            files
            | "SpreadFiles" >> beam.Reshuffle()
            | "ReadFile" >> beam.FlatMap(read_source, self.max_row_bytes)
        )


class _ParseFn(beam.DoFn):
    def __init__(self, schema: str) -> None:
        self.schema = schema

    def process(self, raw: RawRow):
        record, dead = parse_row(raw, self.schema)
        yield (DEAD_LETTER, dead) if dead is not None else (PROBLEMS, record)


class ParseRows(beam.PTransform):
    """RawRow -> outputs `problems` (aligned, normalised records) and `dead_letter`
    (rows that cannot be used, with source, row, reason and the raw row)."""

    def __init__(self, schema: str = "auto") -> None:
        super().__init__()
        if schema != "auto" and schema not in schemas.SCHEMAS:
            raise ValueError(
                f"schema {schema!r} is invalid; allowed: auto, {', '.join(schemas.SCHEMAS)}"
            )
        self.schema = schema

    def expand(self, rows):
        return (
            rows | "Align" >> beam.ParDo(_ParseFn(self.schema)) | SplitTagged(PROBLEMS, DEAD_LETTER)
        )


class SplitTagged(beam.PTransform):
    """PCollection[(tag, value)] -> {tag: PCollection[value]}, one filter per tag.

    The outputs of one DoFn, as `ParDo(...).with_outputs(...)` would give them. Beam's
    DaskRunner (2.77) cannot run `with_outputs`: it keys its Dask bags by the producing
    transform, not by output tag, so every consumer of a tagged output got all of the
    DoFn's outputs (docs/curation.md). Tagged pairs and a filter per tag mean the same on
    every runner; on the FnApiRunner, Dataflow, Flink and Spark the filters fuse with the
    DoFn, so nothing is materialised twice."""

    def __init__(self, *tags: str) -> None:
        super().__init__()
        self.tags = tags

    def expand(self, tagged):
        return {
            tag: tagged | f"Only_{tag}" >> beam.FlatMap(_value_if_tag, tag) for tag in self.tags
        }


def _value_if_tag(pair: tuple[str, Any], tag: str) -> Iterator[Any]:
    if pair[0] == tag:
        yield pair[1]


# ---------------------------------------------------------------------- fingerprint


class _FingerprintFn(beam.DoFn):
    def __init__(self, bands: int, rows: int) -> None:
        self.bands, self.rows = bands, rows

    def process(self, batch: list[dict[str, Any]], index: NgramIndex | None):
        texts = [dedup_text(r["problem"]) for r in batch]
        sigs = minhash.signatures(texts, self.bands * self.rows)
        keys = minhash.band_hashes(sigs, self.bands, self.rows)
        hits = index.lookup_many([r["problem"] for r in batch]) if index is not None else None
        for i, (record, text, band) in enumerate(zip(batch, texts, keys, strict=True)):
            hit = hits[i] if hits is not None else None
            yield Key(record["uid"], record["problem_id"], hash64(text), band.tobytes(), hit)


class Fingerprint(beam.PTransform):
    """Problem records -> `Key`s: dedup hash, MinHash LSH band keys and, given an
    `NgramIndex` side input (AsSingleton), the evaluation sets each problem overlaps."""

    def __init__(self, bands: int, rows: int, eval_index: Any = None) -> None:
        super().__init__()
        self.bands, self.rows = bands, rows
        self.eval_index = eval_index

    def expand(self, records):
        return (
            records
            | "Batch" >> beam.BatchElements(min_batch_size=64, max_batch_size=512)
            | "MinHashAndNgrams"
            >> beam.ParDo(_FingerprintFn(self.bands, self.rows), self.eval_index)
        )


# ----------------------------------------------------------------- packed shuffles


class _PackPairs(beam.DoFn):
    """(keys, value) -> (partition, packed uint64 [key, value] pairs), batched per bundle.

    One bytes object per partition and flush instead of one Python object per entry: the
    runner's shuffle holds 16 bytes per entry.
    """

    def __init__(self, partitions: int, flush_at: int = 1 << 16) -> None:
        self.partitions, self.flush_at = partitions, flush_at

    def start_bundle(self) -> None:
        self._keys: list[int] = []
        self._values: list[int] = []

    def process(self, element: tuple[Iterable[int], int]):
        keys, value = element
        n = len(self._keys)
        self._keys.extend(keys)
        self._values.extend([value] * (len(self._keys) - n))
        if len(self._keys) >= self.flush_at:
            yield from self._flush()

    def finish_bundle(self):
        for item in self._flush():
            yield GlobalWindows.windowed_value(item)

    def _flush(self) -> Iterator[tuple[int, bytes]]:
        if not self._keys:
            return
        pairs = np.column_stack(
            [np.array(self._keys, np.uint64), np.array(self._values, np.uint64)]
        )
        self._keys, self._values = [], []
        parts = pairs[:, 0] % np.uint64(self.partitions)
        for part in np.unique(parts):
            yield int(part), pairs[parts == part].tobytes()


def _unpack(element: tuple[int, Iterable[bytes]]) -> tuple[np.ndarray, np.ndarray]:
    _, blobs = element
    pairs = np.frombuffer(b"".join(sorted(blobs)), np.uint64).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


class PackedGroup(beam.PTransform):
    """PCollection[(keys, value)] -> PCollection[(keys array, values array)], one element
    per partition holding every pair whose key falls in it."""

    def __init__(self, partitions: int = 16) -> None:
        super().__init__()
        self.partitions = partitions

    def expand(self, pairs):
        return (
            pairs
            | "Pack" >> beam.ParDo(_PackPairs(self.partitions))
            | "Group" >> beam.GroupByKey()
            | "Unpack" >> beam.Map(_unpack)
        )


def _drops_from_edges(edges: tuple[np.ndarray, np.ndarray], step: str, reason: str):
    root, member = edges
    for r, m in zip(root.tolist(), member.tolist(), strict=True):
        yield m, Drop(step, reason, ref=r)


def _bucket_edges(group: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return minhash.bucket_edges(*group)


class ExactDedup(beam.PTransform):
    """Keys -> (uid, Drop) for every problem whose normalised text (case and spacing
    ignored) equals that of a problem with a smaller uid (earlier file, earlier row), and
    for every problem reusing the `problem_id` of a smaller uid with another text (ids
    must be unique: pass rates and the trainer join on them)."""

    def __init__(self, partitions: int = 16) -> None:
        super().__init__()
        self.partitions = partitions

    def expand(self, keys):
        by_text = (
            keys
            | "ByTextHash" >> beam.Map(lambda k: ((k.dedup,), k.uid))
            | "GroupByHash" >> PackedGroup(self.partitions)
            | "Duplicates" >> beam.Map(_bucket_edges)
            | "ToDrops" >> beam.FlatMap(_drops_from_edges, "exact_dedup", "exact_duplicate")
        )
        by_id = (
            keys
            | "ByIdHash" >> beam.Map(lambda k: ((hash64(k.problem_id),), k.uid))
            | "GroupById" >> PackedGroup(self.partitions)
            | "SameIds" >> beam.Map(_bucket_edges)
            | "IdDrops" >> beam.FlatMap(_drops_from_edges, "exact_dedup", "duplicate_problem_id")
        )
        return (by_text, by_id) | "Both" >> beam.Flatten()


def _band_pairs(key: Key) -> tuple[list[int], int]:
    return np.frombuffer(key.bands, np.uint64).tolist(), key.uid


def _components(group: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    src, dst = group
    # Packed pairs are (root, member) edges; dedup them before the global union-find.
    edges = (
        np.unique(np.column_stack([src, dst]), axis=0) if len(src) else np.zeros((0, 2), np.uint64)
    )
    members, roots = minhash.components(edges[:, 0], edges[:, 1])
    return roots, members


def _edge_pairs(edges: tuple[np.ndarray, np.ndarray]) -> Iterator[tuple[list[int], int]]:
    root, member = edges
    for r, m in zip(root.tolist(), member.tolist(), strict=True):
        yield [r], m


class NearDedup(beam.PTransform):
    """Keys -> (uid, Drop) for near-duplicates: problems sharing an LSH band are
    candidates; connected components of candidates keep only their smallest uid.

    Buckets yield star edges (bucket minimum, member), so a bucket of m problems costs
    m - 1 edges, never m^2; only the edges go to the single global union-find step.
    """

    def __init__(self, partitions: int = 16) -> None:
        super().__init__()
        self.partitions = partitions

    def expand(self, keys):
        return (
            keys
            | "BandEntries" >> beam.Map(_band_pairs)
            | "GroupByBand" >> PackedGroup(self.partitions)
            | "BucketEdges" >> beam.Map(_bucket_edges)
            | "EdgePairs" >> beam.FlatMap(_edge_pairs)
            | "GatherEdges" >> PackedGroup(1)
            | "Components" >> beam.Map(_components)
            | "ToDrops" >> beam.FlatMap(_drops_from_edges, "near_dedup", "near_duplicate")
        )


def _contaminated(key: Key):
    if key.hit is not None:
        yield (
            key.uid,
            Drop(
                "decontaminate",
                "contaminated",
                eval_sets=",".join(key.hit.eval_sets),
                eval_problem_id=key.hit.eval_problem_id,
            ),
        )


class Decontaminate(beam.PTransform):
    """Keys -> (uid, Drop) for problems sharing a word n-gram with an evaluation
    problem (found by `Fingerprint` against the `NgramIndex`), naming the eval sets."""

    def expand(self, keys):
        return keys | "Contaminated" >> beam.FlatMap(_contaminated)


# ----------------------------------------------------------------------- index, rates


def _index_entries(record: dict[str, Any], names: dict[str, str]) -> tuple[str, str, str]:
    return names[record["source"]], record["problem_id"], record["problem"]


class _BuildIndex(beam.CombineFn):
    def __init__(self, n: int) -> None:
        self.n = n

    def create_accumulator(self):
        return []

    def add_input(self, acc, entry):
        acc.append(entry)
        return acc

    def merge_accumulators(self, accs):
        return [e for acc in accs for e in acc]

    def extract_output(self, acc):
        return NgramIndex.build(self.n, sorted(acc))


class BuildEvalIndex(beam.PTransform):
    """Evaluation problem records -> one `NgramIndex` (use as AsSingleton).

    `names` maps each eval source file to its eval-set name.
    """

    def __init__(self, n: int, names: dict[str, str]) -> None:
        super().__init__()
        self.n, self.names = n, names

    def expand(self, records):
        return (
            records
            | "Entries" >> beam.Map(_index_entries, self.names)
            | "Index" >> beam.CombineGlobally(_BuildIndex(self.n))
        )


def _rate_row(row: dict[str, Any]) -> tuple[str, tuple[int, int, float]]:
    return str(row["problem_id"]), (int(row["version"]), int(row["k"]), float(row["pass_rate"]))


def _read_pass_rates(path: str) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    from beam_jobs.sources import open_source

    with open_source(path) as f:
        # Not read_table: its scanner threads can abort the process at exit
        # (pipeline.parquet_bytes says how often).
        table = pq.ParquetFile(f).read(columns=list(PASS_RATE_COLUMNS), use_threads=False)
    yield from table.to_pylist()


PASS_RATE_COLUMNS = ("problem_id", "pass_rate", "k", "version")


class ReadPassRates(beam.PTransform):
    """Pass-rate Parquet files -> (problem_id, pass_rate); for a problem measured more
    than once, the newest version wins (then the larger k, then the higher rate)."""

    def expand(self, paths):
        return (
            paths
            | "ReadFiles" >> beam.FlatMap(_read_pass_rates)
            | "ById" >> beam.Map(_rate_row)
            | "Newest" >> beam.CombinePerKey(max)
            | "Rate" >> beam.MapTuple(lambda pid, best: (pid, best[2]))
        )


def _band(key: Key, rates: dict[str, float], lo: float, hi: float):
    rate = rates.get(key.problem_id)
    if rate is None:
        yield key.uid, Drop("difficulty", "no_pass_rate")
    elif rate < lo:
        yield key.uid, Drop("difficulty", "below_min_pass_rate", pass_rate=rate)
    elif rate > hi:
        yield key.uid, Drop("difficulty", "above_max_pass_rate", pass_rate=rate)


class DifficultyBand(beam.PTransform):
    """Keys -> (uid, Drop) for problems whose pass rate is outside [lo, hi] or unknown.
    `rates` is a side input (AsDict) problem_id -> pass rate."""

    def __init__(self, rates: Any, lo: float, hi: float) -> None:
        super().__init__()
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(
                f"pass-rate band [{lo}, {hi}] is invalid; allowed: 0 <= min <= max <= 1"
            )
        self.rates, self.lo, self.hi = rates, lo, hi

    def expand(self, keys):
        return keys | "OutsideBand" >> beam.FlatMap(_band, self.rates, self.lo, self.hi)


# Within a step, the reason reported when several apply.
_REASON_ORDER = {"exact_duplicate": 0, "duplicate_problem_id": 1}


def _first_step(a: Drop, b: Drop) -> Drop:
    return min(
        a, b, key=lambda d: (STEPS.index(d.step), _REASON_ORDER.get(d.reason, 9), d.reason, d.ref)
    )


class CombineDrops(beam.PTransform):
    """Drops of all steps -> one (uid, Drop) per removed row: the first step's."""

    def expand(self, drops):
        return (
            drops | "Flatten" >> beam.Flatten() | "FirstStep" >> beam.CombinePerKey(_reduce_drops)
        )


def _reduce_drops(drops: Iterable[Drop]) -> Drop:
    best = None
    for d in drops:
        best = d if best is None else _first_step(best, d)
    return best


# -------------------------------------------------------------------------- pass 2


def _sort_uid(uid: int) -> str:
    return f"{uid:016x}"


class _RouteFn(beam.DoFn):
    def __init__(self, schema: str, val_fraction: float, seed: int, sources: list[str]) -> None:
        self.schema, self.val_fraction, self.seed = schema, val_fraction, seed
        self.sources = sources

    def start_bundle(self) -> None:
        self._stats: Counter = Counter()

    def process(self, raw: RawRow, drops: dict[int, Drop], rates: dict[str, float]):
        record, dead = parse_row(raw, self.schema)
        self._stats[("source", raw.source, "in")] += 1
        if dead is not None:
            self._stats[("dead_letter", dead["reason"], raw.source)] += 1
            uid = dead.pop("uid")
            yield ROWS, (DEAD_LETTER, {**dead, SORT_COLUMN: _sort_uid(uid)})
            return
        uid = record.pop("uid")
        drop = drops.get(uid)
        if drop is not None:
            self._stats[("removed", drop.step, drop.reason, raw.source)] += 1
            for name in filter(None, drop.eval_sets.split(",")):
                self._stats[("eval_hits", name)] += 1
            ref_source, ref_row = (None, None)
            if drop.ref >= 0:
                rank, ref_row = split_uid(drop.ref)
                ref_source = self.sources[rank]
            yield (
                ROWS,
                (
                    "removed",
                    {
                        "source": record["source"],
                        "row": record["row"],
                        "problem_id": record["problem_id"],
                        "task": record["task"],
                        "problem": record["problem"],
                        "step": drop.step,
                        "reason": drop.reason,
                        "duplicate_of_source": ref_source,
                        "duplicate_of_row": ref_row,
                        "eval_sets": drop.eval_sets or None,
                        "eval_problem_id": drop.eval_problem_id or None,
                        "pass_rate": drop.pass_rate,
                        SORT_COLUMN: _sort_uid(uid),
                    },
                ),
            )
            return
        split = assign_split(record["problem_id"], self.val_fraction, self.seed)
        self._stats[("kept", split, raw.source)] += 1
        yield (
            ROWS,
            (
                split,
                {
                    **record,
                    "meta": json.dumps(record["meta"], sort_keys=True, ensure_ascii=False),
                    "pass_rate": rates.get(record["problem_id"]),
                    SORT_COLUMN: f"{record['problem_id']}\x00{_sort_uid(uid)}",
                },
            ),
        )

    def finish_bundle(self):
        for key, count in sorted(self._stats.items()):
            yield GlobalWindows.windowed_value((STATS, (key, count)))


class Route(beam.PTransform):
    """Pass 2: RawRow -> (output, row) with output in train / validation / removed /
    dead_letter, plus a `stats` output of (counter key, count).

    `drops` (AsDict uid -> Drop) and `rates` (AsDict problem_id -> pass rate) are side
    inputs; `sources` lists input paths by rank (to name the surviving duplicate).
    """

    def __init__(
        self,
        schema: str,
        val_fraction: float,
        seed: int,
        sources: list[SourceFile],
        drops: Any,
        rates: Any,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} is invalid; allowed: [0, 1)")
        self.schema, self.val_fraction, self.seed = schema, val_fraction, seed
        self.sources = [s.path for s in sorted(sources, key=lambda s: s.rank)]
        self.drops, self.rates = drops, rates

    def expand(self, rows):
        fn = _RouteFn(self.schema, self.val_fraction, self.seed, self.sources)
        return (
            rows | "RouteRows" >> beam.ParDo(fn, self.drops, self.rates) | SplitTagged(ROWS, STATS)
        )
