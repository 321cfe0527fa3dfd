"""LoRA RL against full RL on the demo, over seeds: the learning evidence of issue 39.

    python benchmarks/lora_demo.py [--seeds 0,1,2] [--ranks 1,8,64] [--lr-scale 10]
                                   [--alpha 32] [--config configs/demo.yaml]
                                   [--out benchmarks/results/lora_demo.md] [key=value ...]

For each seed: the full-RL demo (`rlax demo --config CONFIG seed=S`, the roles as local
processes), then one LoRA run per rank that starts from the very same SFT base: its run is
created with `lora.rank=R lora.alpha=A trainer.lr=<lr-scale x the config's lr>` and the full
run's `data/` and `base/` objects copied into it, so `rlax demo` on it skips data and SFT
(every stage skips finished work) and runs RL, evaluation and the report. Each run's
held-out pass@1 / pass@8 at v0 (the shared base) and at its final version come from its
own evaluation, with paired 95% bootstrap intervals for the gains (benchmarks/demo_seeds.py).

The target: at some rank, LoRA's mean pass@1 gain is >= 0.9 x full RL's mean gain over the
same seeds. LoRA wants a roughly 10x larger learning rate than full fine-tuning ("LoRA
Without Regret", 2025), hence `--lr-scale`; `--lrs` sweeps several LoRA learning rates.
Every run is a row, failures included; the raw rows go next to the table (.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from demo_seeds import _ci, _gain, cpu_name, run_local_seed, write_results  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.run import Run  # noqa: E402

SHARED_PREFIXES = ("data/", "base/")  # what a LoRA run takes from the full run of its seed
TARGET_RATIO = 0.9


def clone_base(full_url: str, url: str, overrides: list[str], config: str) -> None:
    """Create run `url` with the config plus `overrides`, holding the full run's problem
    sets and SFT base (byte for byte), so its demo starts at RL from the same v0."""
    src = Run.open(full_url)
    run = Run.create(url, load_config(config, overrides))
    for prefix in SHARED_PREFIXES:
        for key in src.store.list(prefix):
            run.store.write_new(key, src.store.read(key))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--ranks", default="1,8,64")
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--lr-scale", type=float, default=10.0, help="LoRA lr / full RL lr")
    parser.add_argument(
        "--lrs", default="", help="LoRA learning rates to sweep (overrides --lr-scale)"
    )
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/lora_demo.md"))
    parser.add_argument(
        "--full-rows",
        default="",
        help="a .json of full-RL rows written by an earlier run of this script (--ranks '' "
        "writes only those): reuse them instead of running full RL again",
    )
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    ranks = [int(r) for r in args.ranks.split(",") if r]
    full_lr = load_config(args.config, args.overrides).trainer.lr
    lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else [args.lr_scale * full_lr]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows: list[dict] = []
    reused = json.loads(Path(args.full_rows).read_text()) if args.full_rows else []
    reused = {r["seed"]: r for r in reused if r.get("rank") == 0}
    for seed in seeds:
        if seed in reused:
            full = reused[seed]
        else:
            full = run_local_seed("lora-demo-full", args.config, seed, stamp, args.overrides)
            full.update(mode="full RL", rank=0, lr=full_lr)
        rows.append(full)
        if "error" in full:
            continue
        for rank in ranks:
            for lr in lrs:
                name = f"lora-demo-r{rank}-lr{lr:g}"
                lora = [f"lora.rank={rank}", f"lora.alpha={args.alpha:g}", f"trainer.lr={lr:g}"]
                overrides = [*args.overrides, *lora]
                url = str(ROOT / "runs" / f"{name}-{stamp}" / f"seed{seed}")
                clone_base(full["run"], url, [f"seed={seed}", *overrides], args.config)
                row = run_local_seed(name, args.config, seed, stamp, overrides)
                row.update(mode="LoRA", rank=rank, lr=lr)
                rows.append(row)

    full_gains = [
        100 * r["gain_pass@1"]["mean"] for r in rows if r["rank"] == 0 and "gain_pass@1" in r
    ]
    full_mean = float(np.mean(full_gains)) if full_gains else float("nan")
    cpu = f"{cpu_name()}, {os.cpu_count()} cores"
    lines = [
        "# LoRA RL against full RL on the demo, over seeds",
        "",
        f"`python benchmarks/lora_demo.py --seeds {args.seeds} --ranks {args.ranks} "
        f"--alpha {args.alpha:g}"
        + (f" --lrs {args.lrs}" if args.lrs else f" --lr-scale {args.lr_scale:g}")
        + (" " + " ".join(args.overrides) if args.overrides else "")
        + f"` on {time.strftime('%Y-%m-%d')} ({cpu}), config `{args.config}`. Each LoRA run "
        "starts from its seed's full run's SFT base (the same v0, copied byte for byte), so "
        "its wall time is RL + evaluation only; the full run's includes data and SFT.",
        "",
        "| seed | mode | rank | lr | base pass@1 | final pass@1 | gain pass@1 (points) "
        "| gain pass@8 (points) | wall time | error |",
        "|---|---|---:|---:|---|---|---|---|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['mode']} | {r['rank']} | {r['lr']:g} "
            f"| {_ci(r.get('base_pass@1'))} | {_ci(r.get('final_pass@1'))} "
            f"| {_gain(r.get('gain_pass@1'))} | {_gain(r.get('gain_pass@8'))} "
            f"| {r['wall_s'] / 60:.1f} min | {r.get('error', '')} |"
        )
    lines += [
        "",
        f"Full RL's mean pass@1 gain over {len(full_gains)} seeds: {full_mean:+.1f} points.",
        "",
    ]
    met_any = False
    for rank in ranks:
        for lr in lrs:
            gains = [
                100 * r["gain_pass@1"]["mean"]
                for r in rows
                if r["rank"] == rank and r["lr"] == lr and "gain_pass@1" in r
            ]
            failed = sum(
                1 for r in rows if r["rank"] == rank and r["lr"] == lr and "gain_pass@1" not in r
            )
            if not gains:
                lines.append(f"- rank {rank}, lr {lr:g}: no run finished ({failed} failed)")
                continue
            ratio = float(np.mean(gains)) / full_mean if full_mean else float("nan")
            met = ratio >= TARGET_RATIO and failed == 0 and len(gains) == len(full_gains)
            met_any |= met
            sd = float(np.std(gains, ddof=1)) if len(gains) > 1 else float("nan")
            lines.append(
                f"- rank {rank}, lr {lr:g}: mean pass@1 gain {np.mean(gains):+.1f} points "
                f"(sd {sd:.1f}, {len(gains)} seeds, {failed} failed) = **{ratio:.2f} x full RL**"
                + (" (target met)" if met else "")
            )
    lines += [
        "",
        f"**Target (>= {TARGET_RATIO} x full RL's gain at some rank): "
        f"{'met' if met_any else 'missed'}.**",
    ]
    write_results(args.out, lines, rows)
    return 0 if met_any else 1


if __name__ == "__main__":
    sys.exit(main())
