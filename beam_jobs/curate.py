"""Dataset curation: read -> align -> validate -> dedup -> decontaminate -> difficulty
-> split -> deterministic Parquet shards + stats.json. See docs/curation.md.

    python -m beam_jobs.curate --input 'data/*.jsonl' --output out/curated \
        [--eval-sets 'eval/*.jsonl'] [--pass-rates 'rates/*.parquet'] [Beam options]

Any standard Beam pipeline option passes through (--runner, --direct_num_workers,
--direct_running_mode, --temp_location, ...). The default runner is the local
FnApiRunner, which needs no download and no network.

Output (local directory or gs://bucket/prefix):
    train/part-SSSSS-of-NNNNN.parquet, validation/..., removed/..., dead_letter/...,
    stats.json, _SUCCESS (fingerprint of inputs + options, and a manifest of files).
The job stages everything, then publishes; `_SUCCESS` is written last. Re-running with
the same inputs and options finds `_SUCCESS` and does nothing; `--overwrite` recomputes
(and writes byte-identical files).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from beam_jobs import minhash
from beam_jobs.schemas import SCHEMAS
from beam_jobs.sources import SourceError, SourceFile, match_sources, source_name

log = logging.getLogger("beam_jobs.curate")

VERSION = 1  # bump when a change alters output bytes for the same inputs
SUCCESS = "_SUCCESS"
STATS_FILE = "stats.json"
DEFAULT_RUNNER = "FnApiRunner"  # DirectRunner would first try to download Prism


class CurateError(RuntimeError):
    """The job cannot run as asked (bad arguments, an output that belongs to other inputs)."""


@dataclass(frozen=True)
class CurateOptions:
    inputs: tuple[str, ...]
    output: str
    format: str = "auto"
    schema: str = "auto"
    eval_sets: tuple[str, ...] = ()
    ngram: int = 13
    near_dup_threshold: float = 0.8
    pass_rates: tuple[str, ...] = ()
    min_pass_rate: float = 0.1
    max_pass_rate: float = 0.9
    val_fraction: float = 0.05
    seed: int = 0
    max_row_bytes: int = 1 << 16
    rows_per_shard: int = 100_000
    spill_rows: int = 20_000
    num_perm: int = minhash.NUM_PERM
    staging: str | None = None
    overwrite: bool = False
    beam_args: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, value: Any, allowed: str) -> None:
            if not ok:
                raise CurateError(f"{name}={value!r} is invalid; allowed: {allowed}")

        check(bool(self.inputs), "--input", self.inputs, "one or more globs")
        check(bool(self.output), "--output", self.output, "a local directory or gs://bucket/prefix")
        check(self.ngram >= 1, "--ngram", self.ngram, ">= 1")
        check(
            0 < self.near_dup_threshold < 1,
            "--near-dup-threshold",
            self.near_dup_threshold,
            "(0, 1)",
        )
        check(
            0 <= self.min_pass_rate <= self.max_pass_rate <= 1,
            "--min-pass-rate/--max-pass-rate",
            (self.min_pass_rate, self.max_pass_rate),
            "0 <= min <= max <= 1",
        )
        check(0 <= self.val_fraction < 1, "--val-fraction", self.val_fraction, "[0, 1)")
        check(self.max_row_bytes >= 64, "--max-row-bytes", self.max_row_bytes, ">= 64")
        check(self.rows_per_shard >= 1, "--rows-per-shard", self.rows_per_shard, ">= 1")
        check(self.spill_rows >= 1, "--spill-rows", self.spill_rows, ">= 1")
        check(8 <= self.num_perm <= 1024, "--num-perm", self.num_perm, "8..1024")

    def curation_settings(self) -> dict[str, Any]:
        """The options that decide the output bytes (what the fingerprint covers)."""
        skip = {
            "inputs",
            "output",
            "eval_sets",
            "pass_rates",
            "staging",
            "overwrite",
            "beam_args",
            "spill_rows",
        }
        return {k: v for k, v in asdict(self).items() if k not in skip}


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """Everything resolved before the pipeline starts."""

    options: CurateOptions
    sources: list[SourceFile]
    eval_files: list[SourceFile]
    rate_files: list[str]
    bands: int
    rows: int
    fingerprint: str


def _absolute(pattern: str) -> str:
    from pipeline.storage import local_path

    path = local_path(pattern)
    return pattern if path is None else os.path.abspath(path)


def make_plan(opts: CurateOptions) -> Plan:
    sources = match_sources([_absolute(p) for p in opts.inputs], opts.format, "--input")
    eval_files = (
        match_sources([_absolute(p) for p in opts.eval_sets], "auto", "--eval-sets")
        if opts.eval_sets
        else []
    )
    names = [source_name(f.path) for f in eval_files]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise CurateError(
            f"--eval-sets: several files are named {dupes}; eval set names "
            "come from file names and must be unique"
        )
    rate_sources = (
        match_sources([_absolute(p) for p in opts.pass_rates], "parquet", "--pass-rates")
        if opts.pass_rates
        else []
    )
    rate_files = [f.path for f in rate_sources]
    _check_pass_rate_files(rate_files)
    bands, rows = minhash.lsh_params(opts.near_dup_threshold, opts.num_perm)
    blob = json.dumps(
        {
            "version": VERSION,
            "settings": opts.curation_settings(),
            "inputs": [(f.path, f.size, f.version) for f in sources],
            "eval_sets": [(f.path, f.size, f.version) for f in eval_files],
            "pass_rates": [(f.path, f.size, f.version) for f in rate_sources],
            "lsh": [bands, rows],
        },
        sort_keys=True,
    )
    fingerprint = hashlib.sha256(blob.encode()).hexdigest()
    return Plan(opts, sources, eval_files, rate_files, bands, rows, fingerprint)


def _check_pass_rate_files(paths: list[str]) -> None:
    import pyarrow.parquet as pq

    from beam_jobs.sources import open_source
    from beam_jobs.transforms import PASS_RATE_COLUMNS

    for path in paths:
        with open_source(path) as f:
            names = set(pq.read_schema(f).names)
        missing = [c for c in PASS_RATE_COLUMNS if c not in names]
        if missing:
            raise CurateError(
                f"--pass-rates file {path} lacks columns {missing}; a pass-rate "
                f"file has {', '.join(PASS_RATE_COLUMNS)} (see `rlax pass-rates`)"
            )


# ----------------------------------------------------------------------- pipeline


def build_pipeline(p: Any, plan: Plan, staging: str) -> None:
    """Add the whole job to pipeline `p`; every file it writes lands under `staging`."""
    import apache_beam as beam

    from beam_jobs import transforms as T
    from beam_jobs.decontam import NgramIndex
    from beam_jobs.shards import OUTPUTS, WriteShards

    o = plan.options
    files = p | "Inputs" >> beam.Create(plan.sources)

    # ---- pass 1: compact keys, and what each step removes
    parsed = (
        files | "Pass1Read" >> T.ReadRows(o.max_row_bytes) | "Pass1Parse" >> T.ParseRows(o.schema)
    )

    eval_names = {f.path: source_name(f.path) for f in plan.eval_files}
    if plan.eval_files:
        eval_parsed = (
            p
            | "EvalInputs" >> beam.Create(plan.eval_files)
            | "EvalRead" >> T.ReadRows(o.max_row_bytes)
            | "EvalParse" >> T.ParseRows("auto")
        )
        index = eval_parsed[T.PROBLEMS] | "EvalIndex" >> T.BuildEvalIndex(o.ngram, eval_names)
        eval_counts = (
            (
                eval_parsed[T.PROBLEMS]
                | "EvalOk" >> beam.Map(lambda r: ((r["source"], "rows"), 1)),
                eval_parsed[T.DEAD_LETTER]
                | "EvalBad" >> beam.Map(lambda r: ((r["source"], "unparseable"), 1)),
            )
            | "EvalFlatten" >> beam.Flatten()
            | "EvalCount" >> beam.CombinePerKey(sum)
        )
    else:
        index = p | "NoEvalIndex" >> beam.Create([NgramIndex.build(o.ngram, [])])
        eval_counts = p | "NoEvalCounts" >> beam.Create([])

    keys = parsed[T.PROBLEMS] | "Fingerprint" >> T.Fingerprint(
        plan.bands, plan.rows, beam.pvalue.AsSingleton(index)
    )
    if plan.rate_files:
        rates = p | "RateFiles" >> beam.Create(plan.rate_files) | "PassRates" >> T.ReadPassRates()
    else:
        rates = p | "NoPassRates" >> beam.Create([])
    rates_side = beam.pvalue.AsDict(rates)

    drops_per_step = [
        keys | "ExactDedup" >> T.ExactDedup(),
        keys | "NearDedup" >> T.NearDedup(),
        keys | "Decontaminate" >> T.Decontaminate(),
    ]
    if plan.rate_files:
        drops_per_step.append(
            keys | "Difficulty" >> T.DifficultyBand(rates_side, o.min_pass_rate, o.max_pass_rate)
        )
    drops = tuple(drops_per_step) | "CombineDrops" >> T.CombineDrops()

    # Shard counts from pass-1 counts (kept rows per split are bounded by parsed rows).
    # Each branch is counted before the Flatten, so the counting is combined (lifted)
    # inside pass 1 instead of materialising one element per row.
    counted = (
        keys
        | "SplitOfKey" >> beam.Map(lambda k: T.assign_split(k.problem_id, o.val_fraction, o.seed))
        | "CountSplits" >> beam.combiners.Count.PerElement(),
        parsed[T.DEAD_LETTER]
        | "DeadOne" >> beam.Map(lambda _: "dead_letter")
        | "CountDead" >> beam.combiners.Count.PerElement(),
        drops
        | "RemovedOne" >> beam.Map(lambda _: "removed")
        | "CountRemoved" >> beam.combiners.Count.PerElement(),
        p | "ZeroCounts" >> beam.Create([(name, 0) for name in OUTPUTS]),
    ) | "FlattenCounts" >> beam.Flatten()
    shard_counts = (
        counted
        | "CountPerOutput" >> beam.CombinePerKey(sum)
        | "NumShards" >> beam.MapTuple(lambda out, n: (out, max(1, -(-n // o.rows_per_shard))))
    )
    shard_side = beam.pvalue.AsDict(shard_counts)

    # ---- pass 2: route every row, write deterministic shards
    routed = (
        files
        | "Pass2Read" >> T.ReadRows(o.max_row_bytes)
        | "Route"
        >> T.Route(
            o.schema, o.val_fraction, o.seed, plan.sources, beam.pvalue.AsDict(drops), rates_side
        )
    )
    written = routed[T.ROWS] | "Write" >> WriteShards(staging, shard_side, o.spill_rows)
    stats = routed[T.STATS] | "SumStats" >> beam.CombinePerKey(sum)

    summary = {
        "version": VERSION,
        "fingerprint": plan.fingerprint,
        "settings": o.curation_settings(),
        "lsh": {
            "num_perm": o.num_perm,
            "bands": plan.bands,
            "rows": plan.rows,
            "shingle_chars": minhash.SHINGLE_CHARS,
        },
        "inputs": [f.path for f in plan.sources],
        "eval_sets": {f.path: source_name(f.path) for f in plan.eval_files},
        "pass_rates": plan.rate_files,
    }
    _ = (
        p
        | "Finalize" >> beam.Create([None])
        | "WriteStats"
        >> beam.Map(
            _finalize,
            staging,
            summary,
            beam.pvalue.AsList(written),
            shard_side,
            beam.pvalue.AsList(stats),
            beam.pvalue.AsList(eval_counts),
        )
    )


def _finalize(_, staging, summary, written, shard_counts, stats, eval_counts) -> None:
    """Write empty files for shards that got no row, then stats.json."""
    from apache_beam.io.filesystems import FileSystems

    from beam_jobs.shards import OUTPUTS, missing_shards, shard_path, write_empty

    for output, shard in missing_shards(written, shard_counts):
        write_empty(shard_path(staging, output, shard, shard_counts[output]), OUTPUTS[output])
    report = build_stats(summary, stats, eval_counts, written, shard_counts)
    with FileSystems.create(FileSystems.join(staging, STATS_FILE)) as f:
        f.write(json.dumps(report, indent=2, sort_keys=True).encode() + b"\n")


def build_stats(summary, stats, eval_counts, written, shard_counts) -> dict[str, Any]:
    """stats.json: counts in/out per step, per reason and per source (deterministic)."""
    from beam_jobs.transforms import SPLITS, STEPS

    total = 0
    dead: dict[str, int] = defaultdict(int)
    removed: dict[str, dict[str, int]] = {s: defaultdict(int) for s in STEPS}
    kept: dict[str, int] = defaultdict(int)
    eval_hits: dict[str, int] = defaultdict(int)
    sources: dict[str, dict[str, Any]] = defaultdict(
        lambda: {
            "in": 0,
            "dead_letter": defaultdict(int),
            "removed": defaultdict(int),
            "train": 0,
            "validation": 0,
        }
    )
    for key, count in stats:
        kind = key[0]
        if kind == "source":
            sources[key[1]]["in"] += count
            total += count
        elif kind == "dead_letter":
            dead[key[1]] += count
            sources[key[2]]["dead_letter"][key[1]] += count
        elif kind == "removed":
            removed[key[1]][key[2]] += count
            sources[key[3]]["removed"][key[1]] += count
        elif kind == "kept":
            kept[key[1]] += count
            sources[key[2]][key[1]] += count
        elif kind == "eval_hits":
            eval_hits[key[1]] += count

    applied = {
        "decontaminate": bool(summary["eval_sets"]),
        "difficulty": bool(summary["pass_rates"]),
    }
    n_dead = sum(dead.values())
    steps: list[dict[str, Any]] = [
        {"step": "parse", "in": total, "out": total - n_dead, "removed": dict(dead)}
    ]
    flowing = total - n_dead
    for step in STEPS:
        n = sum(removed[step].values())
        steps.append(
            {
                "step": step,
                "applied": applied.get(step, True),
                "in": flowing,
                "out": flowing - n,
                "removed": dict(removed[step]),
            }
        )
        flowing -= n
    steps.append({"step": "split", "in": flowing, **{s: kept[s] for s in SPLITS}})

    rows_written: dict[str, int] = defaultdict(int)
    for output, _, rows in written:
        rows_written[output] += rows
    evals: dict[str, dict[str, int]] = {}
    names = summary["eval_sets"]
    for name in sorted(set(names.values())):
        evals[name] = {
            "rows": 0,
            "unparseable": 0,
            "contaminated_train_rows": eval_hits.get(name, 0),
        }
    for (path, what), count in eval_counts:
        evals[names[path]][what] += count
    return {
        **summary,
        "rows_in": total,
        "steps": steps,
        "eval_sets": evals,
        "sources": {
            path: {**v, "dead_letter": dict(v["dead_letter"]), "removed": dict(v["removed"])}
            for path, v in sorted(sources.items())
        },
        "outputs": {
            name: {"rows": rows_written.get(name, 0), "shards": shard_counts[name]}
            for name in sorted(shard_counts)
        },
    }


# ------------------------------------------------------------------ staging, publish


def _is_remote(path: str) -> bool:
    from pipeline.storage import local_path

    return local_path(path) is None


def _staged_files(staging: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(staging):
        dirnames[:] = sorted(d for d in dirnames if d != "_runs")
        for name in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, name), staging).replace(os.sep, "/")
            out.append(rel)
    return sorted(out)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _manifest(plan: Plan, staging: str) -> bytes:
    files = {
        rel: {
            "bytes": os.path.getsize(os.path.join(staging, rel)),
            "sha256": _sha256(os.path.join(staging, rel)),
        }
        for rel in _staged_files(staging)
    }
    return (
        json.dumps(
            {"fingerprint": plan.fingerprint, "version": VERSION, "files": files},
            indent=2,
            sort_keys=True,
        ).encode()
        + b"\n"
    )


def read_success(output: str) -> dict[str, Any] | None:
    from pipeline.storage import ObjectNotFound, open_store

    try:
        return json.loads(open_store(output).read(SUCCESS))
    except ObjectNotFound:
        return None


def publish(plan: Plan, staging: str) -> None:
    """Move the staged output into place; `_SUCCESS` appears last."""
    output = plan.options.output
    manifest = _manifest(plan, staging)
    shutil.rmtree(os.path.join(staging, "_runs"), ignore_errors=True)
    if _is_remote(output):
        from pipeline.storage import open_store

        store = open_store(output)
        store.delete(SUCCESS)  # readers must not trust a prefix while it changes
        new = _staged_files(staging)
        for rel in new:
            store.delete(rel)  # create-only writes: replace what an earlier attempt left
            store.write_new_file(rel, os.path.join(staging, rel))
        for stale in sorted(set(store.list("")) - set(new)):
            store.delete(stale)
        store.write_new(SUCCESS, manifest)
        shutil.rmtree(staging, ignore_errors=True)
        return
    with open(os.path.join(staging, SUCCESS), "wb") as f:
        f.write(manifest)
    target = _absolute(output)
    old = None
    if os.path.exists(target):
        old = f"{target}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)  # replaced whole (briefly absent), never a mix of two runs
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.move(staging, target)  # a rename when --staging is on the same filesystem
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _staging_dir(plan: Plan) -> str:
    o = plan.options
    if o.staging:
        if _is_remote(o.staging):
            raise CurateError(
                f"--staging {o.staging!r} is invalid; allowed: a local directory "
                "(the output itself may be gs://)"
            )
        return _absolute(o.staging)
    if _is_remote(o.output):
        return tempfile.mkdtemp(prefix="rlax-curate-")
    # Beside the output, so the final move is a rename on the same filesystem.
    target = _absolute(o.output)
    return f"{target}.staging-{plan.fingerprint[:12]}"


# --------------------------------------------------------------------------- main


def pipeline_options(beam_args: Sequence[str]) -> Any:
    from apache_beam.options.pipeline_options import PipelineOptions

    args = list(beam_args)
    if not any(a == "--runner" or a.startswith("--runner=") for a in args):
        args.append(f"--runner={DEFAULT_RUNNER}")
    return PipelineOptions(args)


def run(opts: CurateOptions) -> dict[str, Any]:
    """Run (or skip) the job; returns stats.json's content."""
    plan = make_plan(opts)
    existing = read_success(opts.output)
    if existing is not None and not opts.overwrite:
        if existing.get("fingerprint") == plan.fingerprint:
            log.info(
                "output %s is complete for these inputs and options; nothing to do", opts.output
            )
            from pipeline.storage import open_store

            return json.loads(open_store(opts.output).read(STATS_FILE))
        raise CurateError(
            f"output {opts.output} already holds a complete curation of other inputs or options "
            f"(fingerprint {existing.get('fingerprint', '?')[:12]} != {plan.fingerprint[:12]}); "
            "choose another --output or pass --overwrite"
        )
    staging = _staging_dir(plan)
    if os.path.exists(staging):
        shutil.rmtree(staging)  # what a crashed attempt left; runs are recomputed
    os.makedirs(staging, exist_ok=True)

    import apache_beam as beam

    started = time.time()
    with beam.Pipeline(options=pipeline_options(opts.beam_args)) as p:
        build_pipeline(p, plan, staging)
    with open(os.path.join(staging, STATS_FILE)) as f:
        stats = json.load(f)
    publish(plan, staging)
    log.info("curation done in %.1fs", time.time() - started)
    return stats


def format_report(stats: dict[str, Any]) -> str:
    lines = [f"rows in: {stats['rows_in']}"]
    for s in stats["steps"]:
        if s["step"] == "split":
            lines.append(f"  split: train {s['train']}, validation {s['validation']}")
            continue
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["removed"].items())) or "-"
        if not s.get("applied", True):
            reasons = "(not applied)"
        lines.append(f"  {s['step']:<14} in {s['in']:>9}  out {s['out']:>9}  removed: {reasons}")
    for name, e in stats["eval_sets"].items():
        lines.append(
            f"  eval set {name}: {e['rows']} rows, "
            f"{e['contaminated_train_rows']} training rows removed as contaminated"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m beam_jobs.curate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="GLOB",
        help="source files (local or gs://); repeatable",
    )
    p.add_argument("--output", required=True, metavar="DIR", help="local dir or gs://bucket/prefix")
    p.add_argument("--format", default="auto", choices=["auto", "jsonl", "parquet", "csv"])
    p.add_argument("--schema", default="auto", choices=["auto", *SCHEMAS])
    p.add_argument(
        "--eval-sets",
        action="append",
        default=[],
        metavar="GLOB",
        help="evaluation sets to decontaminate against (one set per file); repeatable",
    )
    p.add_argument("--ngram", type=int, default=13, help="word n-gram length for decontamination")
    p.add_argument(
        "--near-dup-threshold",
        type=float,
        default=0.8,
        help="Jaccard similarity of near duplicates (MinHash LSH)",
    )
    p.add_argument(
        "--pass-rates",
        action="append",
        default=[],
        metavar="GLOB",
        help="pass-rate Parquet from `rlax pass-rates`; repeatable",
    )
    p.add_argument("--min-pass-rate", type=float, default=0.1)
    p.add_argument("--max-pass-rate", type=float, default=0.9)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="seed of the train/validation split")
    p.add_argument(
        "--max-row-bytes",
        type=int,
        default=1 << 16,
        help="rows larger than this are dead-lettered as oversized",
    )
    p.add_argument("--rows-per-shard", type=int, default=100_000)
    p.add_argument(
        "--spill-rows",
        type=int,
        default=20_000,
        help="rows a writer sorts in memory before spilling a run file",
    )
    p.add_argument("--num-perm", type=int, default=minhash.NUM_PERM, help="MinHash permutations")
    p.add_argument(
        "--staging",
        help="local directory to stage in before publishing (default: "
        "beside a local output; a temp dir when the output is gs://)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="recompute even if --output is complete, replacing it",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> CurateOptions:
    args, beam_args = build_parser().parse_known_args(argv)
    return CurateOptions(
        inputs=tuple(args.input),
        output=args.output,
        format=args.format,
        schema=args.schema,
        eval_sets=tuple(args.eval_sets),
        ngram=args.ngram,
        near_dup_threshold=args.near_dup_threshold,
        pass_rates=tuple(args.pass_rates),
        min_pass_rate=args.min_pass_rate,
        max_pass_rate=args.max_pass_rate,
        val_fraction=args.val_fraction,
        seed=args.seed,
        max_row_bytes=args.max_row_bytes,
        rows_per_shard=args.rows_per_shard,
        spill_rows=args.spill_rows,
        num_perm=args.num_perm,
        staging=args.staging,
        overwrite=args.overwrite,
        beam_args=tuple(beam_args),
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        opts = parse_args(argv)
        stats = run(opts)
    except (CurateError, SourceError) as err:
        print(f"curate: {err}", file=sys.stderr)
        return 2
    print(format_report(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
