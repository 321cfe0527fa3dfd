"""Each curation PTransform on its own, with TestPipeline and assert_that."""

from __future__ import annotations

import json

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.util import assert_that, equal_to

from beam_jobs import transforms as T
from beam_jobs.decontam import NgramIndex
from beam_jobs.shards import OUTPUTS, SORT_COLUMN, WriteShards
from beam_jobs.sources import RawRow, SourceFile, make_uid
from tests.beam_jobs.fixtures import change_one_word, problem_text

RNG = np.random.default_rng(7)
TEXTS = [problem_text(RNG) for _ in range(6)]


def gsm_raw(rank: int, row: int, question: str, answer: str = "#### 1") -> RawRow:
    fields = {"question": question, "answer": answer}
    return RawRow(make_uid(rank, row), f"f{rank}.jsonl", row, fields, json.dumps(fields))


def record(uid: int, text: str, pid: str | None = None) -> dict:
    return {"uid": uid, "problem_id": pid or f"p{uid}", "problem": text, "source": "s", "row": uid}


def test_read_rows(tmp_path, make_pipeline):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "#### 1"}\nnot json\n\n{"x": "\xff"}\n')
    with make_pipeline() as p:
        rows = p | beam.Create([SourceFile(3, str(path), "jsonl")]) | T.ReadRows(1024)
        summary = rows | beam.Map(lambda r: (r.uid, r.row, r.error[0] if r.error else None))
        assert_that(
            summary,
            equal_to(
                [
                    (make_uid(3, 0), 0, None),
                    (make_uid(3, 1), 1, "invalid_json"),
                    (make_uid(3, 3), 3, "invalid_utf8"),
                ]
            ),
        )


def test_parse_rows_splits_problems_and_dead_letters(make_pipeline):
    raws = [
        gsm_raw(0, 0, "What is  1,000 + 1?", "so\n#### 1,001"),
        gsm_raw(0, 1, "What?", "no marker"),
        RawRow(
            2, "f0.jsonl", 2, {"problem": r"Half of 1?", "solution": r"\boxed{\frac{1}{2}}"}, "{}"
        ),
        RawRow(3, "f0.jsonl", 3, None, "xx", ("invalid_json", "bad")),
        RawRow(4, "f0.jsonl", 4, {"foo": 1}, "{}"),
    ]
    with make_pipeline() as p:
        out = p | beam.Create(raws) | T.ParseRows("auto")
        problems = out[T.PROBLEMS] | "P" >> beam.Map(
            lambda r: (r["row"], r["task"], r["problem"], r["answer"])
        )
        dead = out[T.DEAD_LETTER] | "D" >> beam.Map(lambda r: (r["row"], r["reason"], r["source"]))
        assert_that(
            problems,
            equal_to(
                [
                    (0, "math", "What is 1,000 + 1?", "1001"),
                    (2, "math", "Half of 1?", r"\frac{1}{2}"),
                ]
            ),
            label="ok",
        )
        assert_that(
            dead,
            equal_to(
                [
                    (1, "no_answer", "f0.jsonl"),
                    (3, "invalid_json", "f0.jsonl"),
                    (4, "unknown_schema", "f0.jsonl"),
                ]
            ),
            label="dead",
        )


def test_parse_rows_rejects_unknown_schema_name():
    with pytest.raises(ValueError, match="allowed: auto, rlax, gsm8k, math"):
        T.ParseRows("alpaca")


def _keys(p, records, index=None):
    idx = p | "Index" >> beam.Create([index or NgramIndex.build(13, [])])
    return (
        p | "Records" >> beam.Create(records) | T.Fingerprint(9, 13, beam.pvalue.AsSingleton(idx))
    )


def test_exact_dedup_keeps_smallest_uid(make_pipeline):
    a, b = TEXTS[0], TEXTS[1]
    records = [
        record(5, a),
        record(2, a.upper()),
        record(9, "  " + a),
        record(7, b),
        record(8, b),
        record(11, TEXTS[5], pid="p7"),
    ]  # another text under the id of uid 7
    with make_pipeline() as p:
        drops = _keys(p, records) | T.ExactDedup(partitions=3)
        assert_that(
            drops | beam.MapTuple(lambda uid, d: (uid, d.reason, d.ref)),
            equal_to(
                [
                    (5, "exact_duplicate", 2),
                    (9, "exact_duplicate", 2),
                    (8, "exact_duplicate", 7),
                    (11, "duplicate_problem_id", 7),
                ]
            ),
        )


def test_near_dedup_clusters_transitively(make_pipeline):
    a = TEXTS[2]
    b = change_one_word(a)
    c = b.replace(b.split(" ")[3], "hovercraft", 1)  # one more word away from a
    records = [record(4, b), record(1, a), record(6, c), record(3, TEXTS[3]), record(2, TEXTS[4])]
    with make_pipeline() as p:
        drops = _keys(p, records) | T.NearDedup(partitions=2)
        assert_that(
            drops | beam.MapTuple(lambda uid, d: (uid, d.reason, d.ref)),
            equal_to([(4, "near_duplicate", 1), (6, "near_duplicate", 1)]),
        )


def test_decontaminate_names_the_eval_set(make_pipeline):
    evals = [
        {"source": "e/gsm.jsonl", "problem_id": "g1", "problem": TEXTS[0]},
        {"source": "e/math.jsonl", "problem_id": "m1", "problem": TEXTS[1]},
    ]
    records = [
        record(1, "Intro words. " + TEXTS[0]),
        record(2, TEXTS[1] + " and " + TEXTS[0]),
        record(3, TEXTS[2]),
        record(4, " ".join(TEXTS[1].split()[:12])),
    ]  # 12 < 13 words
    with make_pipeline() as p:
        index = (
            p
            | "Evals" >> beam.Create(evals)
            | T.BuildEvalIndex(13, {"e/gsm.jsonl": "gsm", "e/math.jsonl": "math"})
        )
        keys = p | beam.Create(records) | T.Fingerprint(9, 13, beam.pvalue.AsSingleton(index))
        drops = keys | T.Decontaminate()
        assert_that(
            drops | beam.MapTuple(lambda uid, d: (uid, d.eval_sets, d.eval_problem_id)),
            equal_to([(1, "gsm", "g1"), (2, "gsm,math", "g1")]),
        )


def test_pass_rates_and_difficulty_band(tmp_path, make_pipeline):
    path = tmp_path / "rates.parquet"
    pq.write_table(
        pa.table(
            {
                "problem_id": ["p1", "p2", "p3", "p4", "p4"],
                "pass_rate": [
                    0.05,
                    0.5,
                    0.95,
                    0.0,
                    0.5,
                ],  # p4: version 2 (0.5) supersedes version 1
                "k": [8, 8, 8, 8, 8],
                "version": [1, 1, 1, 1, 2],
            }
        ),
        path,
    )
    with make_pipeline() as p:
        rates = p | "Files" >> beam.Create([str(path)]) | T.ReadPassRates()
        assert_that(
            rates, equal_to([("p1", 0.05), ("p2", 0.5), ("p3", 0.95), ("p4", 0.5)]), label="rates"
        )
        keys = [T.Key(i, f"p{i}", 0, b"", None) for i in (1, 2, 3, 4, 5)]
        drops = (
            p | "Keys" >> beam.Create(keys) | T.DifficultyBand(beam.pvalue.AsDict(rates), 0.1, 0.9)
        )
        assert_that(
            drops | beam.MapTuple(lambda uid, d: (uid, d.reason, d.pass_rate)),
            equal_to(
                [
                    (1, "below_min_pass_rate", 0.05),
                    (3, "above_max_pass_rate", 0.95),
                    (5, "no_pass_rate", None),
                ]
            ),
            label="drops",
        )


def test_combine_drops_attributes_the_first_step(make_pipeline):
    with make_pipeline() as p:
        a = p | "A" >> beam.Create(
            [
                (1, T.Drop("decontaminate", "contaminated")),
                (2, T.Drop("difficulty", "no_pass_rate")),
            ]
        )
        b = p | "B" >> beam.Create([(1, T.Drop("near_dedup", "near_duplicate", ref=0))])
        c = p | "C" >> beam.Create([(1, T.Drop("exact_dedup", "exact_duplicate", ref=0))])
        out = (a, b, c) | T.CombineDrops()
        assert_that(
            out | beam.MapTuple(lambda uid, d: (uid, d.step)),
            equal_to([(1, "exact_dedup"), (2, "difficulty")]),
        )


def test_route_sends_each_row_to_one_output(make_pipeline):
    sources = [SourceFile(0, "f0.jsonl", "jsonl")]
    raws = [gsm_raw(0, 0, TEXTS[0]), gsm_raw(0, 1, TEXTS[0].upper()), gsm_raw(0, 2, "q", "none")]
    drops = [(make_uid(0, 1), T.Drop("exact_dedup", "exact_duplicate", ref=make_uid(0, 0)))]
    with make_pipeline() as p:
        d = beam.pvalue.AsDict(p | "Drops" >> beam.Create(drops))
        r = beam.pvalue.AsDict(p | "Rates" >> beam.Create([]))
        out = p | beam.Create(raws) | T.Route("auto", 0.0, 0, sources, d, r)
        assert_that(
            out["rows"] | beam.MapTuple(lambda o, row: (o, row["row"])),
            equal_to([("train", 0), ("removed", 1), ("dead_letter", 2)]),
            label="rows",
        )
        removed = (
            out["rows"]
            | beam.Filter(lambda x: x[0] == "removed")
            | beam.Map(lambda x: (x[1]["duplicate_of_source"], x[1]["duplicate_of_row"]))
        )
        assert_that(removed, equal_to([("f0.jsonl", 0)]), label="ref")
        assert_that(
            out[T.STATS] | beam.CombinePerKey(sum),
            equal_to(
                [
                    (("source", "f0.jsonl", "in"), 3),
                    (("kept", "train", "f0.jsonl"), 1),
                    (("removed", "exact_dedup", "exact_duplicate", "f0.jsonl"), 1),
                    (("dead_letter", "no_answer", "f0.jsonl"), 1),
                ]
            ),
            label="stats",
        )


def test_assign_split_is_deterministic_and_calibrated():
    ids = [f"id{i}" for i in range(20000)]
    splits = [T.assign_split(i, 0.1, 3) for i in ids]
    assert splits == [T.assign_split(i, 0.1, 3) for i in ids]
    assert abs(splits.count("validation") / len(ids) - 0.1) < 0.01
    assert [T.assign_split(i, 0.1, 4) for i in ids] != splits  # the seed matters


def _dead_rows(n):
    return [
        (
            "dead_letter",
            {
                "source": "s",
                "row": i,
                "reason": "r",
                "detail": "d",
                "raw": "x",
                SORT_COLUMN: f"{i:016x}",
            },
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("spill_rows", [3, 1000])
def test_write_shards_sorted_and_independent_of_spilling(tmp_path, make_pipeline, spill_rows):
    rows = _dead_rows(50)
    rows = rows[::-1]  # arrival order must not matter
    root = str(tmp_path / "out")
    with make_pipeline() as p:
        counts = beam.pvalue.AsDict(p | "Counts" >> beam.Create([("dead_letter", 3)]))
        written = p | beam.Create(rows) | WriteShards(root, counts, spill_rows=spill_rows)
        assert_that(
            written | beam.MapTuple(lambda o, s, n: (o, s)),
            equal_to([("dead_letter", s) for s in range(3)]),
        )
    total = []
    for shard in range(3):
        t = pq.read_table(f"{root}/dead_letter/part-{shard:05d}-of-00003.parquet")
        assert t.schema == OUTPUTS["dead_letter"]
        got = t.column("row").to_pylist()
        assert got == sorted(got)
        total += got
    assert sorted(total) == list(range(50))
    digest = [
        (tmp_path / "out/dead_letter" / f).read_bytes()
        for f in sorted(p.name for p in (tmp_path / "out/dead_letter").iterdir())
    ]
    # Same files whatever the spill size: compare against a fresh run with the other size.
    other = str(tmp_path / "other")
    with make_pipeline() as p:
        counts = beam.pvalue.AsDict(p | "Counts" >> beam.Create([("dead_letter", 3)]))
        _ = (
            p
            | beam.Create(rows)
            | WriteShards(other, counts, spill_rows=7 if spill_rows == 3 else 2)
        )
    assert digest == [
        (tmp_path / "other/dead_letter" / f).read_bytes()
        for f in sorted(p.name for p in (tmp_path / "other/dead_letter").iterdir())
    ]
