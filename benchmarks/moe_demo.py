"""The mixture-of-experts demo over seeds: does a MoE model learn as the dense demo does?

    python benchmarks/moe_demo.py [--seeds 0,1,2] [--config configs/demo_moe.yaml]
                                  [--out benchmarks/results/moe_demo.md] [key=value ...]

Each seed is `rlax demo --config configs/demo_moe.yaml --run R seed=S ...` (no Airflow: the
roles as local processes; `demo_seeds.run_local_seed`), timed from start to exit, so the
wall time includes data, SFT, RL and both evaluations. From the run's own files: the SFT
base (v0) and the final version's held-out pass@1 / pass@8 with the evaluator's 95%
bootstrap intervals, the gains with a paired 95% interval, and the routers' load from the
trainer's step records (`tpu_jobs.model.moe.expert_load_metrics`: the busiest expert's share of
the routed tokens over the mean share, the idlest's, the router entropy in nats, and
the load-balancing loss) at the first and the last step.

Target (issue 38, item 7; the dense demo's): pass@1 at least +20 points and pass@8 at
least +10 over the seed's own base, within 10 minutes each. Every seed is a row, failed
or not. Writes the table to `--out` and the raw numbers next to it (.json).
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
    MAX_BASE_PASS8,
    MAX_WALL_S,
    MIN_PROBLEMS,
    TARGET_PASS1,
    TARGET_PASS8,
    _ci,
    _gain,
    cpu_name,
    gain_spread,
    meets_target,
    run_local_seed,
    write_results,
)

from pipeline.run import Run  # noqa: E402

LOAD_KEYS = ("expert_load_max", "expert_load_min", "router_entropy", "router_aux_loss")


def expert_load(run: Run) -> dict:
    """The routers' load metrics of the trainer's first and last step."""
    steps = sorted(run.read_metrics("train"), key=lambda m: m["step"])
    if not steps:
        return {}
    return {
        f"{when}_{key}": steps[i].get(key)
        for when, i in (("first", 0), ("last", -1))
        for key in LOAD_KEYS
    }


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--config", default="configs/demo_moe.yaml")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/moe_demo.md"))
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every seed")
    args = parser.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        row = run_local_seed("moe-demo", args.config, seed, stamp, args.overrides, expert_load)
        row["met"] = meets_target(row)
        rows.append(row)
    lines = [
        "# The mixture-of-experts demo over seeds",
        "",
        f"`python benchmarks/moe_demo.py --seeds {args.seeds}"
        + (" " + " ".join(args.overrides) if args.overrides else "")
        + f"` on {time.strftime('%Y-%m-%d')} ({cpu_name()}, {os.cpu_count()} cores), config "
        f"`{args.config}`: each seed is `rlax demo` with `seed=S`, timed from start to exit.",
        "",
        f"Target per seed: pass@1 >= +{100 * TARGET_PASS1:.0f} points and pass@8 >= "
        f"+{100 * TARGET_PASS8:.0f} over the seed's own SFT base, base pass@8 <= "
        f"{MAX_BASE_PASS8}, >= {MIN_PROBLEMS} held-out problems, <= {MAX_WALL_S / 60:.0f} min "
        "(the dense demo's target, `demo_seeds.meets_target`). "
        "Expert load: the busiest / idlest expert's share of routed tokens over the mean "
        "share (1 = balanced), router entropy (nats), load-balancing loss; trainer step 1 -> "
        "the last step.",
        "",
        "| seed | base pass@1 | final pass@1 | gain pass@1 | base pass@8 | final pass@8 "
        "| gain pass@8 | max load | min load | router entropy | aux loss | wall | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def span(key: str, r: dict = r) -> str:
            return f"{_f(r.get(f'first_{key}'))} -> {_f(r.get(f'last_{key}'))}"

        verdict = "met" if r["met"] else "**missed**" + (f" ({r['error']})" if "error" in r else "")
        lines.append(
            f"| {r['seed']} | {_ci(r.get('base_pass@1'))} | {_ci(r.get('final_pass@1'))} "
            f"| {_gain(r.get('gain_pass@1'))} | {_ci(r.get('base_pass@8'))} "
            f"| {_ci(r.get('final_pass@8'))} | {_gain(r.get('gain_pass@8'))} "
            + " ".join(f"| {span(k)}" for k in LOAD_KEYS)
            + f" | {r['wall_s'] / 60:.1f} min | {verdict} |"
        )
    lines += ["", *gain_spread(rows), ""]
    lines.append(f"**{sum(r['met'] for r in rows)} of {len(rows)} seeds met the target.**")
    write_results(args.out, lines, rows)
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
