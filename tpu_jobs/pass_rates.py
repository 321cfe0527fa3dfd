"""Per-problem pass rates under a published weight snapshot: the difficulty signal that
the curation job (`beam_jobs.curate --pass-rates`) filters on.

    python -m tpu_jobs.pass_rates --run RUN_URL --data GLOB --k 8 [--version V]
                                  [--output URL] [--temperature T] [--batch-size N]

Samples k completions per problem with version V of the run's weights (default: the
latest published), scores them with the task verifiers and writes one Parquet row per
problem: problem_id, pass_rate (= correct / k), k, version, plus task and num_correct.
Default output: `{run}/pass_rates/v{V:08d}-k{k}-{data hash}.parquet`, written
create-only, so a repeated call finds it and does nothing. Sampling keys depend on the
run seed, the version, the problem's place in id order and the sample index only.

`--data`: Parquet files of Problem rows (problem_id, task, prompt, answer, meta), e.g. a
curation output (`.../train/*.parquet`) or a run's `data/train.parquet`; local or gs://.
Problems of a task without a verifier in `pipeline.tasks` are skipped (and counted).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from dataclasses import replace

import numpy as np
import pyarrow as pa

from pipeline.paramserver import ParamServer
from pipeline.parquet_bytes import table_from_bytes, table_to_bytes
from pipeline.run import Run, policy_reader
from pipeline.storage import glob, local_path, open_parent
from pipeline.tasks import TASKS
from pipeline.tasks.base import Problem
from tpu_jobs.generate.episodes import sample_rows
from tpu_jobs.generate.interface import sampling_params
from tpu_jobs.generate.policy import load_policy
from tpu_jobs.generate.sample_verify import PASS_RATE_STREAM, sample_keys

SCHEMA = pa.schema(
    [
        pa.field("problem_id", pa.string(), nullable=False),
        pa.field("pass_rate", pa.float64(), nullable=False),
        pa.field("k", pa.int64(), nullable=False),
        pa.field("version", pa.int64(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("num_correct", pa.int64(), nullable=False),
    ]
)
_COLUMNS = ["problem_id", "task", "prompt", "answer", "meta"]


def match_files(pattern: str) -> list[str]:
    """Files matching a local or gs:// glob, sorted."""
    return [m.url for m in glob(pattern)]


def _read_bytes(url: str) -> bytes:
    path = local_path(url)
    if path is not None:
        return path.read_bytes()
    store, key = open_parent(url)
    return store.read(key)


def load_problems(pattern: str) -> list[Problem]:
    """Problem rows of every matched Parquet file, unique by id, in id order."""
    files = match_files(pattern)
    if not files:
        raise SystemExit(f"pass_rates: --data {pattern!r} matched no files")
    by_id: dict[str, Problem] = {}
    for path in files:
        table = table_from_bytes(_read_bytes(path))
        missing = [c for c in _COLUMNS[:4] if c not in table.column_names]
        if missing:
            raise SystemExit(
                f"pass_rates: {path} lacks columns {missing}; Problem rows need "
                f"{', '.join(_COLUMNS)}"
            )
        cols = [c for c in _COLUMNS if c in table.column_names]
        for row in table.select(cols).to_pylist():
            p = Problem.from_dict(row)
            by_id.setdefault(p.problem_id, p)
    return [by_id[k] for k in sorted(by_id)]


def pass_rates(
    run: Run,
    problems: list[Problem],
    k: int,
    version: int | None,
    *,
    temperature: float | None = None,
    batch_size: int | None = None,
    log=print,
) -> pa.Table:
    """Sample k completions per problem with one weight version and score them."""
    cfg = run.config
    # A LoRA run's version is adapters: merged into the run's base (policy_reader).
    snapshot = policy_reader(run).pull(version)
    policy = load_policy(run, "pass_rates", snapshot=snapshot)
    params = sampling_params(cfg, "pass_rates")
    if temperature is not None:  # --temperature: the one setting this job may override
        params = replace(params, temperature=temperature)
    batch_size = batch_size or cfg.eval.batch_size
    keys = sample_keys(cfg.seed, PASS_RATE_STREAM, snapshot.version, 0, len(problems), k)
    scored = sample_rows(  # tool episodes when the run sets an environment
        policy.sampler,
        policy.model,
        policy.tok,
        cfg.environment,
        [p for p in problems for _ in range(k)],
        keys,
        params,
        batch_size=batch_size,
        on_batch=lambda done, total: log(
            f"[pass-rates] v{snapshot.version}: {done}/{total} samples"
        ),
    )
    correct = (scored.rewards >= 1.0).reshape(len(problems), k).astype(np.int64)
    n_correct = correct.sum(axis=1)
    return pa.Table.from_pydict(
        {
            "problem_id": [p.problem_id for p in problems],
            "pass_rate": (n_correct / k).astype(np.float64),
            "k": np.full(len(problems), k, np.int64),
            "version": np.full(len(problems), snapshot.version, np.int64),
            "task": [p.task for p in problems],
            "num_correct": n_correct,
        },
        schema=SCHEMA,
    )


def default_key(version: int, k: int, problems: list[Problem]) -> str:
    digest = hashlib.sha256("\n".join(p.problem_id for p in problems).encode()).hexdigest()
    return f"pass_rates/v{version:08d}-k{k}-{digest[:12]}.parquet"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tpu_jobs.pass_rates",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--run", required=True, help="run URL (local dir or gs://)")
    ap.add_argument("--data", required=True, help="glob of Problem Parquet files")
    ap.add_argument("--k", type=int, default=8, help="samples per problem")
    ap.add_argument("--version", type=int, help="weight version (default: latest published)")
    ap.add_argument("--output", help="output Parquet URL (default: inside the run, see above)")
    ap.add_argument("--temperature", type=float, help="default: the run's sampler.temperature")
    ap.add_argument(
        "--batch-size", type=int, help="rows per generate call (default: eval.batch_size)"
    )
    args = ap.parse_args(argv)
    if args.k < 1:
        ap.error(f"--k={args.k} is invalid; allowed: >= 1")

    run = Run.open(args.run)
    problems = load_problems(args.data)
    unknown = sorted({p.task for p in problems} - set(TASKS))
    if unknown:
        print(
            f"[pass-rates] skipping {sum(p.task in unknown for p in problems)} problems of "
            f"tasks without a verifier: {', '.join(unknown)} (known: {', '.join(sorted(TASKS))})"
        )
        problems = [p for p in problems if p.task in TASKS]
    if not problems:
        print("pass_rates: no problem with a known task to rate", file=sys.stderr)
        return 2
    version = args.version if args.version is not None else ParamServer(run.store).latest_version()
    if version is None:
        print(f"pass_rates: run {args.run} has no published weights yet", file=sys.stderr)
        return 2
    if args.output:
        store, key = open_parent(args.output)
    else:
        store, key = run.store, default_key(version, args.k, problems)
    if store.exists(key):
        print(f"[pass-rates] {store.url_of(key)} exists; nothing to do")
        return 0
    t0 = time.time()
    table = pass_rates(
        run, problems, args.k, version, temperature=args.temperature, batch_size=args.batch_size
    )
    store.write_new(key, table_to_bytes(table))
    rates = table.column("pass_rate").to_numpy()
    print(
        f"[pass-rates] wrote {store.url_of(key)}: {len(rates)} problems, k={args.k}, "
        f"v{version}, mean pass rate {rates.mean():.3f}, {time.time() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    from pipeline.entrypoint import run_main

    sys.exit(run_main("pass-rates", main))
