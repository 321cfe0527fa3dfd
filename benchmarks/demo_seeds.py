"""The demo's learning target over several seeds: one `make demo` per seed, every seed reported.

    python benchmarks/demo_seeds.py [--seeds 0,1,2] [--local] [--out benchmarks/results/demo_seeds.md]
                                    [key=value ...]

Each seed is the very command a user runs, `make demo ARGS="--run R seed=S ..."` (the DAG
through a project-local Airflow; `--local`: `make demo-local`), timed from start to exit,
so the wall time includes everything the user waits for. Then, from the run's own files:
the SFT base (v0) and the final version's held-out pass@1 / pass@8 with their 95% bootstrap
intervals (the evaluator's), the gains with a *paired* 95% bootstrap interval over the same
problems (both versions are scored on the same held-out set), the SFT steps used and the
wall time. A seed passes when pass@1 gains >= +20 points and pass@8 >= +10 over its own base,
the base's pass@8 is <= 0.6, there are >= 500 held-out problems, and the wall time is
<= 10 minutes. Failed or crashed seeds are rows of the table too.

Writes the table to `--out` and the raw numbers next to it (.json). Exit code 1 if any seed
misses the target.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.metrics import bootstrap_ci  # noqa: E402
from pipeline.metrics import per_problem_pass as problem_pass  # noqa: E402
from pipeline.paramserver import ParamServer, SnapshotNotFoundError  # noqa: E402
from pipeline.parquet_bytes import table_from_bytes  # noqa: E402
from pipeline.run import Run  # noqa: E402
from tpu_jobs.evaluator import eval_key  # noqa: E402

TARGET_PASS1 = 0.20
TARGET_PASS8 = 0.10
MAX_BASE_PASS8 = 0.6
MIN_PROBLEMS = 500
MAX_WALL_S = 600.0
KS = (1, 8)


def per_problem_pass(run: Run, version: int) -> dict[int, np.ndarray]:
    """{k: per-problem unbiased pass@k} of `version` from its per-sample eval table, in
    problem order (`pipeline.metrics.per_problem_pass`)."""
    cols = table_from_bytes(run.store.read(eval_key(version))).to_pydict()
    return {k: np.asarray(list(problem_pass(cols, k).values())) for k in KS}


def seed_row(run: Run, seed: int, wall_s: float, code: int) -> dict:
    records = {r["version"]: r for r in run.read_metrics("eval")}
    row: dict = {"seed": seed, "wall_s": wall_s, "exit_code": code, "run": run.url}
    try:  # the SFT base is version 0 of the run's base/ parameter server (tpu_jobs.sft)
        meta = ParamServer(run.store.child("base")).manifest(0).get("metadata", {})
    except SnapshotNotFoundError:  # the run failed before SFT ended
        meta = {}
    row["sft_steps"] = meta.get("steps")
    row["sft_loss"] = meta.get("final_loss")
    row["sft_target_reached"] = meta.get("target_reached")
    if 0 not in records or len(records) < 2:
        row["error"] = f"evaluated versions: {sorted(records)}"
        return row
    final = max(records)
    row["final_version"] = final
    row["num_problems"] = records[0]["num_problems"]
    base, last = per_problem_pass(run, 0), per_problem_pass(run, final)
    for k in KS:
        name = f"pass@{k}"
        row[f"base_{name}"] = records[0]["metrics"][name]
        row[f"final_{name}"] = records[final]["metrics"][name]
        mean, lo, hi = bootstrap_ci(last[k] - base[k], seed=seed)
        row[f"gain_{name}"] = {"mean": mean, "lo": lo, "hi": hi}
    row["passed"] = meets_target(row)
    return row


def meets_target(row: dict) -> bool:
    """The demo's learning target for a `seed_row` (the MoE demo's too): it ran to the end,
    pass@1 and pass@8 gained at least TARGET_PASS1 / TARGET_PASS8 over a base with pass@8
    at most MAX_BASE_PASS8, on at least MIN_PROBLEMS held-out problems, within MAX_WALL_S."""
    return bool(
        row.get("exit_code") == 0
        and "gain_pass@1" in row
        and row["gain_pass@1"]["mean"] >= TARGET_PASS1
        and row["gain_pass@8"]["mean"] >= TARGET_PASS8
        and row["base_pass@8"]["mean"] <= MAX_BASE_PASS8
        and row["num_problems"] >= MIN_PROBLEMS
        and row["wall_s"] <= MAX_WALL_S
    )


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def _ci(m: dict | None) -> str:
    return "–" if not m else f"{m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]"


def _gain(m: dict | None) -> str:
    if not m:
        return "–"
    return f"{100 * m['mean']:+.1f} [{100 * m['lo']:+.1f}, {100 * m['hi']:+.1f}]"


def table(rows: list[dict]) -> list[str]:
    out = [
        "| seed | base pass@1 | final pass@1 | gain pass@1 (points) | base pass@8 | final pass@8 "
        "| gain pass@8 (points) | SFT steps | wall time | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        steps = r.get("sft_steps")
        if steps is not None and r.get("sft_target_reached") is False:
            steps = f"{steps} (cap; loss {r['sft_loss']:.3f})"
        verdict = (
            "met" if r.get("passed") else f"**missed**{' ' + r['error'] if 'error' in r else ''}"
        )
        out.append(
            f"| {r['seed']} | {_ci(r.get('base_pass@1'))} | {_ci(r.get('final_pass@1'))} "
            f"| {_gain(r.get('gain_pass@1'))} | {_ci(r.get('base_pass@8'))} "
            f"| {_ci(r.get('final_pass@8'))} | {_gain(r.get('gain_pass@8'))} | {steps} "
            f"| {r['wall_s'] / 60:.1f} min | {verdict} |"
        )
    return out


def gain_spread(rows: list[dict]) -> list[str]:
    """Mean and standard deviation over the seeds that finished, of each gain."""
    out = []
    for name in ("pass@1", "pass@8"):
        gains = [100 * r[f"gain_{name}"]["mean"] for r in rows if f"gain_{name}" in r]
        if gains:
            sd = float(np.std(gains, ddof=1)) if len(gains) > 1 else float("nan")
            out.append(
                f"- {name} gain over {len(gains)} seeds: mean {np.mean(gains):+.1f} points, "
                f"sd {sd:.1f}, range [{min(gains):+.1f}, {max(gains):+.1f}]"
            )
    return out


def write_results(out: str | Path, lines: list[str], rows: list[dict]) -> None:
    """The table at `out` (markdown), the raw rows next to it (.json); printed too."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    print("\n".join(lines))


def run_local_seed(
    name: str, config: str, seed: int, stamp: str, overrides: list[str], extra=None
) -> dict:
    """One seed of `rlax demo --config CONFIG --run R seed=S ...` (no Airflow: the roles as
    local processes), timed from start to exit, as a `seed_row` (plus `extra(run)`'s keys);
    a crashed seed is a row too. R is runs/NAME-STAMP/seedS."""
    url = str(ROOT / "runs" / f"{name}-{stamp}" / f"seed{seed}")
    cmd = [sys.executable, "-m", "pipeline.ops.cli", "demo", "--config", config]
    cmd += ["--run", url, f"seed={seed}", *overrides]
    print(f"=== seed {seed}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    code = subprocess.call(cmd, cwd=ROOT)
    wall = time.monotonic() - t0
    try:
        run = Run.open(url)
        row = seed_row(run, seed, wall, code)
        if extra is not None:
            row.update(extra(run))
    except Exception as exc:  # a crashed seed is a row too
        row = {"seed": seed, "wall_s": wall, "exit_code": code, "error": repr(exc)}
    row.pop("passed", None)  # the arithmetic demo's target applies to that demo only
    print(json.dumps(row, indent=1, default=str), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--local", action="store_true", help="make demo-local (no Airflow)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/demo_seeds.md"))
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every seed")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = "demo-local" if args.local else "demo"
    rows = []
    for seed in seeds:
        url = str(ROOT / "runs" / f"demo-seeds-{stamp}" / f"seed{seed}")
        cmd_args = " ".join([f"--run {url}", f"seed={seed}", *args.overrides])
        print(f"=== seed {seed}: make {target} ARGS='{cmd_args}'", flush=True)
        t0 = time.monotonic()
        code = subprocess.call(["make", "-s", target, f"ARGS={cmd_args}"], cwd=ROOT)
        wall = time.monotonic() - t0
        try:
            row = seed_row(Run.open(url), seed, wall, code)
        except Exception as exc:  # a crashed seed is a row too
            row = {"seed": seed, "wall_s": wall, "exit_code": code, "error": repr(exc)}
        rows.append(row)
        print(json.dumps(row, indent=1, default=str), flush=True)

    met = sum(bool(r.get("passed")) for r in rows)
    cpu = f"{cpu_name()}, {os.cpu_count()} cores"
    lines = [
        "# The demo's learning target over seeds",
        "",
        f"`python benchmarks/demo_seeds.py --seeds {args.seeds}"
        + (" --local" if args.local else "")
        + (" " + " ".join(args.overrides) if args.overrides else "")
        + f"` on {time.strftime('%Y-%m-%d')} ({cpu}): each seed is `make {target}` with "
        "`seed=S`, timed from start to exit.",
        "",
        f"Target per seed: held-out pass@1 >= +{100 * TARGET_PASS1:.0f} points and pass@8 >= "
        f"+{100 * TARGET_PASS8:.0f} over the seed's own SFT base (v0), base pass@8 <= "
        f"{MAX_BASE_PASS8}, >= {MIN_PROBLEMS} held-out problems, <= {MAX_WALL_S / 60:.0f} min. "
        "Pass rates: 95% bootstrap intervals over problems; gains: paired 95% bootstrap "
        "intervals (the same problems at both versions).",
        "",
        *table(rows),
        "",
        f"**{met} of {len(rows)} seeds met the target.**",
    ]
    write_results(args.out, lines, rows)
    return 0 if met == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
