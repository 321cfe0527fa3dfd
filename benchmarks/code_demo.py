"""The demo on the synthetic code family over seeds: learning, and time spent on the sandbox.

    python benchmarks/code_demo.py [--seeds 0,1,2] [--config configs/demo_code.yaml]
                                   [--out benchmarks/results/code_demo.md] [--no-humaneval]
                                   [key=value ...]

Each seed is `rlax demo --config configs/demo_code.yaml --run R seed=S ...` (no Airflow:
the roles as local processes), timed from start to exit. From the run's own files:
held-out pass@1 / pass@8 of the SFT base (v0) and of the final version with the
evaluator's 95% bootstrap intervals, the gains with a paired 95% bootstrap interval (the
same held-out problems at both versions; `benchmarks/demo_seeds.py`'s numbers), and from
the rollout workers' per-batch records (`metrics/rollout/`): the share of each batch's
wall time spent waiting on the sandbox after generation (`verify_wait_s / seconds`), the
sandbox's total time per batch (`verify_s`, part of it may overlap generation), its runs
per batch (one per distinct program of a prompt: a repeated one is run once) and its
throughput (runs per second of `verify_s`).

The target per seed is the arithmetic demo's (`demo_seeds.meets_target`): pass@1 +20
points and pass@8 +10 over the seed's own SFT base, base pass@8 at most 0.6, at least 500
held-out problems, within 10 minutes. After each seed's demo (not in its 10 minutes),
`rlax eval --version latest --dataset humaneval` scores the final version on HumanEval's
164 problems in the sandbox, timed: what RL on the synthetic family gives on a real
benchmark (near 0 at this size; what it shows is that the path runs end to end).

Writes the table to `--out` and the raw numbers next to it (.json). Reports every seed,
failed or not.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from demo_seeds import (  # noqa: E402
    _ci,
    _gain,
    cpu_name,
    gain_spread,
    meets_target,
    run_local_seed,
    seed_row,
    write_results,
)

from pipeline.rollouts import from_parquet_bytes  # noqa: E402
from pipeline.run import Run  # noqa: E402


def sandbox_share(run: Run) -> dict:
    """Per committed rollout batch: the sandbox wait's share of the batch's wall time, the
    sandbox's seconds, and its runs per second. A run is a distinct (problem, program) pair
    of the batch (`verify_rows` runs a repeated pair once); `distinct_share` is their
    share of the batch's rows."""
    records = [r for r in run.read_metrics("rollout") if r.get("committed")]
    if not records:
        return {}
    cfg = run.config
    rows = cfg.rollout.prompts_per_batch * cfg.rollout.group_size
    keys = [k for k in run.store.list("rollouts/") if k.endswith(".parquet")]
    runs = []
    for key in keys:  # the stored batches: the committed ones
        batch = from_parquet_bytes(run.store.read(key))
        runs.append(len(set(zip(batch.prompt_id, batch.completion, strict=True))))
    wait = np.asarray([r["verify_wait_s"] for r in records])
    spent = np.asarray([r["verify_s"] for r in records])
    wall = np.asarray([r["seconds"] for r in records])
    share = wait / wall
    return {
        "batches": len(records),
        "rows_per_batch": rows,
        "runs_per_batch_mean": float(np.mean(runs)),
        "distinct_share": float(np.sum(runs) / (rows * len(runs))),
        "wait_share_mean": float(share.mean()),
        "wait_share_median": float(np.median(share)),
        "wait_share_max": float(share.max()),
        "verify_s_mean": float(spent.mean()),
        "batch_s_mean": float(wall.mean()),
        "runs_per_s": float(np.mean(runs) / spent.mean()),
    }


def humaneval(run: Run) -> dict:
    """`rlax eval --version latest --dataset humaneval` on the run, timed: its pass@1 and
    pass@8 with the evaluator's intervals, or the exit code when it failed."""
    cmd = [sys.executable, "-m", "pipeline.ops.cli", "eval", "--run", run.url]
    cmd += ["--version", "latest", "--dataset", "humaneval"]
    t0 = time.monotonic()
    code = subprocess.call(cmd, cwd=ROOT)
    out: dict = {"exit_code": code, "seconds": time.monotonic() - t0}
    records = run.read_metrics("eval-humaneval")
    if code == 0 and records:
        record = max(records, key=lambda r: r["version"])
        out["version"], out["num_problems"] = record["version"], record["num_problems"]
        out.update({k: record["metrics"][k] for k in ("pass@1", "pass@8")})
    return out


def table(rows: list[dict]) -> list[str]:
    out = [
        "| seed | base pass@1 | final pass@1 | gain pass@1 (points) | base pass@8 | final pass@8 "
        "| gain pass@8 (points) | sandbox wait / batch (mean, max) | sandbox s / batch "
        "| runs / batch | runs/s | wall time | target | HumanEval pass@1 (final version) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r.get("sandbox") or {}
        share = f"{100 * s['wait_share_mean']:.0f}%, {100 * s['wait_share_max']:.0f}%" if s else "–"
        sec = f"{s['verify_s_mean']:.2f} of {s['batch_s_mean']:.2f}" if s else "–"
        rate = f"{s['runs_per_s']:.0f}" if s else "–"
        runs = f"{s['runs_per_batch_mean']:.0f} of {s['rows_per_batch']}" if s else "–"
        err = f" ({r['error']})" if "error" in r else ""
        he = r.get("humaneval") or {}
        he_text = (
            f"{_ci(he['pass@1'])} ({he['seconds']:.0f} s)"
            if "pass@1" in he
            else (f"failed, exit {he['exit_code']}" if he else "–")
        )
        out.append(
            f"| {r['seed']}{err} | {_ci(r.get('base_pass@1'))} | {_ci(r.get('final_pass@1'))} "
            f"| {_gain(r.get('gain_pass@1'))} | {_ci(r.get('base_pass@8'))} "
            f"| {_ci(r.get('final_pass@8'))} | {_gain(r.get('gain_pass@8'))} | {share} | {sec} "
            f"| {runs} | {rate} | {r['wall_s'] / 60:.1f} min | {'met' if r.get('passed') else 'missed'} "
            f"| {he_text} |"
        )
    return out


def spread(rows: list[dict]) -> list[str]:
    """Each gain's spread over the seeds, and the sandbox's share of a batch."""
    out = gain_spread(rows)
    met = sum(bool(r.get("passed")) for r in rows)
    out.append(f"- target met on {met} of {len(rows)} seeds")
    shares = [100 * r["sandbox"]["wait_share_mean"] for r in rows if r.get("sandbox")]
    if shares:
        out.append(
            f"- sandbox wait share of a rollout batch, mean over seeds: {np.mean(shares):.0f}% "
            f"(per seed {', '.join(f'{s:.0f}%' for s in shares)})"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--config", default="configs/demo_code.yaml")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/code_demo.md"))
    parser.add_argument(
        "--existing",
        action="append",
        default=[],
        metavar="SEED=URL:WALL_S",
        help="also report a finished run of the same command (its wall time as measured)",
    )
    parser.add_argument(
        "--no-humaneval",
        action="store_true",
        help="skip the HumanEval evaluation of each seed's final version",
    )
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every seed")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for spec in args.existing:
        seed, rest = spec.split("=", 1)
        url, wall = rest.rsplit(":", 1)
        run = Run.open(url)
        row = seed_row(run, int(seed), float(wall), 0)
        row["sandbox"] = sandbox_share(run)
        rows.append(row)
    for seed in seeds:
        extra = lambda run: {"sandbox": sandbox_share(run)}  # noqa: E731
        rows.append(run_local_seed("code-demo", args.config, seed, stamp, args.overrides, extra))
    for row in rows:
        row["passed"] = meets_target(row)
        if not args.no_humaneval and "run" in row:
            row["humaneval"] = humaneval(Run.open(row["run"]))

    cpu = f"{cpu_name()}, {os.cpu_count()} cores"
    lines = [
        "# The demo on the synthetic code family, over seeds",
        "",
        f"`python benchmarks/code_demo.py --seeds {args.seeds} --config {args.config}"
        + "".join(f" --existing {e}" for e in args.existing)
        + (" " + " ".join(args.overrides) if args.overrides else "")
        + f"` on {time.strftime('%Y-%m-%d')} ({cpu}): each seed is `rlax demo` with "
        "`seed=S`, timed from start to exit.",
        "",
        "Pass rates: held-out problems, 8 samples each, 95% bootstrap intervals; gains: "
        "paired 95% bootstrap intervals (the same problems at both versions). Sandbox wait: "
        "the part of a rollout batch's wall time spent waiting on the sandbox after "
        "generation (`verify_wait_s / seconds` of `metrics/rollout/`).",
        "",
        *table(sorted(rows, key=lambda r: r["seed"])),
        "",
        *spread(rows),
    ]
    write_results(args.out, lines, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
