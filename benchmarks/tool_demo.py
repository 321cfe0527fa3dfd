"""The demo with a Python tool over seeds: does RL learn to call the tool, and does it pay?

    python benchmarks/tool_demo.py [--seeds 0,1,2] [--config configs/demo_tools.yaml]
                                   [--out benchmarks/results/tool_demo.md] [key=value ...]

Each seed is `rlax demo --config configs/demo_tools.yaml --run R seed=S ...` (no Airflow:
the roles as local processes), timed from start to exit. From the run's own files, for the
SFT base (v0) and the final version: held-out pass@1 / pass@8 with the evaluator's 95%
bootstrap intervals, the gains with a paired 95% bootstrap interval (`demo_seeds`), and how
the evaluated episodes used the tool (`tools` of the evaluator's records: the fraction of
episodes that called it, the fraction of calls that ran cleanly, mean turns); and one
final-version episode printed as a reader sees it.

Target (issue 21): pass@1 at least +20 points and a tool-call rate that rises, within 10
minutes on the 2-core machine. Writes the table to `--out` and the raw numbers next to it
(.json); every seed is reported, failed or not.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from demo_seeds import (  # noqa: E402
    _ci,
    _gain,
    cpu_name,
    gain_spread,
    run_local_seed,
    write_results,
)

from pipeline.parquet_bytes import table_from_bytes  # noqa: E402
from pipeline.run import Run  # noqa: E402
from tpu_jobs.evaluator import eval_key  # noqa: E402

TARGET_PASS1 = 0.20
MAX_WALL_S = 600.0


def tool_use(run: Run) -> dict:
    """The evaluator's tool-use numbers of v0 and the final version, and one final-version
    episode that called the tool (the first, by problem order)."""
    records = {r["version"]: r for r in run.read_metrics("eval")}
    if 0 not in records or len(records) < 2:
        return {}
    final = max(records)
    out = {
        f"{name}_tools": records[v].get("tools", {}) for name, v in (("base", 0), ("final", final))
    }
    table = table_from_bytes(run.store.read(eval_key(final)))
    cols = table.to_pydict()
    prompts = {p.problem_id: p.prompt for p in run.read_problems("eval")}
    for i, calls in enumerate(cols.get("tool_calls", [])):
        if calls:
            prompt = prompts[cols["problem_id"][i]]
            out["episode"] = {"prompt": prompt, "completion": cols["completion"][i]}
            out["episode"]["reward"] = cols["reward"][i]
            break
    return out


def passed(r: dict) -> bool:
    base, final = r.get("base_tools") or {}, r.get("final_tools") or {}
    return bool(
        r.get("exit_code") == 0
        and "gain_pass@1" in r
        and r["gain_pass@1"]["mean"] >= TARGET_PASS1
        and final.get("tool_call_rate", 0) > base.get("tool_call_rate", 1)
        and r["wall_s"] <= MAX_WALL_S
    )


def _rate(tools: dict, key: str) -> str:
    v = tools.get(key)
    return "–" if v is None else f"{v:.2f}"


def table(rows: list[dict]) -> list[str]:
    out = [
        "| seed | base pass@1 | final pass@1 | gain pass@1 (points) | base pass@8 | final pass@8 "
        "| gain pass@8 (points) | tool-call rate (v0 → final) | call success (v0 → final) "
        "| mean turns (v0 → final) | wall time | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, f = r.get("base_tools") or {}, r.get("final_tools") or {}
        err = f" ({r['error']})" if "error" in r else ""
        out.append(
            f"| {r['seed']}{err} | {_ci(r.get('base_pass@1'))} | {_ci(r.get('final_pass@1'))} "
            f"| {_gain(r.get('gain_pass@1'))} | {_ci(r.get('base_pass@8'))} "
            f"| {_ci(r.get('final_pass@8'))} | {_gain(r.get('gain_pass@8'))} "
            f"| {_rate(b, 'tool_call_rate')} → {_rate(f, 'tool_call_rate')} "
            f"| {_rate(b, 'tool_success_rate')} → {_rate(f, 'tool_success_rate')} "
            f"| {_rate(b, 'mean_turns')} → {_rate(f, 'mean_turns')} "
            f"| {r['wall_s'] / 60:.1f} min | {'met' if passed(r) else 'missed'} |"
        )
    return out


def episode_text(ep: dict) -> list[str]:
    """One episode as a reader sees it: the prompt, then the completion verbatim."""
    return [
        "```text",
        ep["prompt"] + ep["completion"],
        "```",
        f"(reward {ep['reward']:g}; the ```output block is the tool's, appended by the "
        "environment and masked out of the loss)",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--config", default="configs/demo_tools.yaml")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/tool_demo.md"))
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every seed")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    load = os.getloadavg()
    rows = [
        run_local_seed("tool-demo", args.config, seed, stamp, args.overrides, tool_use)
        for seed in seeds
    ]
    met = sum(passed(r) for r in rows)
    example = next((r["episode"] for r in rows if "episode" in r), None)
    lines = [
        "# The demo with a Python tool, over seeds",
        "",
        f"`python benchmarks/tool_demo.py --seeds {args.seeds} --config {args.config}"
        + (" " + " ".join(args.overrides) if args.overrides else "")
        + f"` on {time.strftime('%Y-%m-%d')} ({cpu_name()}, {os.cpu_count()} cores; load "
        f"average at the start {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}): each seed is "
        "`rlax demo` with `seed=S`, timed from start to exit (data, SFT, RL, evaluation of "
        "v0 and the final version, report).",
        "",
        f"Target per seed: held-out pass@1 >= +{100 * TARGET_PASS1:.0f} points over the "
        f"seed's own SFT base (v0), a tool-call rate that rises, <= {MAX_WALL_S / 60:.0f} min. "
        "Pass rates: 95% bootstrap intervals over problems; gains: paired 95% bootstrap "
        "intervals (the same problems at both versions). Tool-call rate: the fraction of "
        "held-out episodes that called the tool; call success: the fraction of calls that "
        "ran without an error.",
        "",
        *table(sorted(rows, key=lambda r: r["seed"])),
        "",
        *gain_spread(rows),
        "",
        f"**{met} of {len(rows)} seeds met the target.**",
    ]
    if example is not None:
        lines += ["", "A final-version episode that called the tool:", "", *episode_text(example)]
    write_results(args.out, lines, rows)
    return 0 if met == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
