"""Self-PRM that pays without costing solving: the judging recipe over seeds, every variant.

    python benchmarks/selfprm.py [--seeds 0,1,2] [--variants w0.25,plain]
                                 [--config configs/demo.yaml] [key=value ...]
                                 [--out benchmarks/results/selfprm.md] [--fresh]
                                 [--add VARIANT:SEED:RUN:WALL_S:NOTE ...]

Each (variant, seed) is `rlax demo --config CONFIG --run R seed=S KEY=VALUE... OVERRIDES`
(no Airflow: the roles as local processes; `demo_seeds.run_local_seed`), timed from start
to exit, so the wall time includes SFT, RL and both evaluations. The recipe is the config plus the
command line's key=value overrides (every variant gets them); a variant adds the overrides
of `VARIANTS`; `plain` is the same recipe without any judging (no judging SFT, no judge
groups, the same 32 solve groups per batch), the control of the solving cost, matched by
recipe and seed.

From the final version's eval record: pass@1, maj@8, Self-PRM@8 and their paired
difference with its 95% bootstrap interval (the evaluator's, over the same problems), the
judge's within-problem AUC and its precision on the hardest difficulty tercile (the seed
paper's other finding); from v0 the base's, for the gains. A recipe seed meets issue 41's
target when Self-PRM@8 - maj@8 has its interval above 0, its pass@1 is within 3 points
of (or above) the control run of the same recipe and seed, and the run took <= 10
minutes.

Rows accumulate in `--out`'s .json (one per variant, seed and code, failures included:
every variant tried stays in the table); `--fresh` starts a new file. The judging code
changed under the table (`ERAS`): each row records the era it ran in, and the table shows
each era apart. The control runs no judging code, so one control row per seed serves
every era (its bytes are the same in all of them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from demo_seeds import _ci, _gain, cpu_name, run_local_seed, seed_row, write_results  # noqa: E402

from pipeline.run import Run  # noqa: E402

K = 8
MAX_WALL_S = 600.0
MAX_PASS1_COST = 0.03  # pass@1 may trail the control run of the same seed by this much
CONTROL = "plain"
READING = "## Reading"

# The judging code a row ran under: era -> what it was. Rows without an era ran in the first.
ERAS = {
    1: "before the judge-format fix: no EOS between the judged solution and ';ok?'",
    2: "EOS before ';ok?' (`pipeline.tasks.judge`, 09295b6): today's code",
    3: (
        "experiment 3774e33, reverted: only the verdict is an SFT target of a judging demonstration"
    ),
}
ERA = 2  # the era of the code in the tree

# The judging SFT most variants share (`no-judge` is it alone, the control of the rows of
# era 1 when they were made): a quarter of the demonstrations end with the verdict of a
# solution a fair coin made correct or wrong (configs/demo_judge.yaml's SFT).
JUDGE_SFT = ["sft.judge_fraction=0.25", "sft.judge_labels=balanced"]
# 8 judge groups beside the 32 solve groups of the controls, judging same-problem pairs.
JUDGE_GROUPS = [
    "rollout.prompts_per_batch=40",
    "rollout.judge_fraction=0.2",
    "rollout.judge_pick=problem",
]

# name -> (what it changes, overrides of --config). Every variant that was tried stays
# here, so that each row of the results can be reproduced.
SLIPS_SFT = ["sft.judge_fraction=0.25", "sft.judge_labels=slips"]
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "plain": ("no judging at all: no judging SFT, no judge groups", []),
    "slips": ("judging SFT with slips (sft.judge_labels=slips), no judge groups", SLIPS_SFT),
    "no-judge": (
        "judging SFT, no judge groups (32 solve groups per batch)",
        JUDGE_SFT,
    ),
    "w0.25": (
        "judging SFT, 8 judge groups + 32 solve groups, judge rows' loss weight 0.25",
        [*JUDGE_SFT, *JUDGE_GROUPS, "trainer.judge_loss_weight=0.25"],
    ),
    "w1": (
        "as w0.25 with judge rows weighing as solve rows",
        [*JUDGE_SFT, *JUDGE_GROUPS, "trainer.judge_loss_weight=1.0"],
    ),
    "sft0.5-16g-w0.25": (
        "half the SFT demonstrations judging, 16 judge groups + 32 solve groups, weight 0.25",
        [
            "sft.judge_fraction=0.5",
            "sft.judge_labels=balanced",
            "rollout.prompts_per_batch=48",
            "rollout.judge_fraction=0.3333",
            "rollout.judge_pick=problem",
            "trainer.judge_loss_weight=0.25",
        ],
    ),
}


def judging(run: Run) -> dict:
    """The final version's Self-PRM numbers (and v0's), from the run's eval records."""
    records = {r["version"]: r for r in run.read_metrics("eval")}
    out: dict = {}
    for name, version in (("base", 0), ("final", max(records, default=None))):
        if version is None or version not in records:
            continue
        rec = records[version]
        m = rec["metrics"]
        out[name] = {
            key: m.get(key)
            for key in (
                "pass@1",
                f"maj@{K}",
                f"self_prm@{K}",
                f"self_prm_vs_maj@{K}",
                "judge_auc_within",
                f"self_conf_vs_maj@{K}",
                "conf_auc_within",
            )
        }
        hard = rec.get("judge", {}).get("self_prm", {}).get("by_difficulty", {}).get("hard", {})
        out[name]["hard_precision"] = hard.get("precision")
        out[name]["hard_judged_yes"] = hard.get("judged_yes")
    return out


def era_of(row: dict) -> int | None:
    """The row's era; None for the control, which runs no judging code."""
    return None if is_control(row) else int(row.get("era", 1))


def is_control(row: dict) -> bool:
    return row["variant"] == CONTROL


def recipe_of(row: dict) -> str:
    """The config and the overrides every variant of the row's command got."""
    return row.get("recipe", row.get("config", "configs/demo.yaml"))


def verdicts(rows: list[dict]) -> None:
    """Each row's target (`met`), against the control row of its recipe and seed."""
    control = {(recipe_of(r), r["seed"]): r for r in rows if is_control(r)}
    for r in rows:
        if is_control(r):
            continue
        final = r.get("final", {})
        diff = final.get(f"self_prm_vs_maj@{K}")
        ref = control.get((recipe_of(r), r["seed"]), {}).get("final", {}).get("pass@1")
        p1 = final.get("pass@1")
        r["pass1_vs_control"] = None if ref is None or p1 is None else p1["mean"] - ref["mean"]
        r["met"] = bool(
            r.get("exit_code") == 0
            and diff is not None
            and diff["lo"] > 0
            and r["pass1_vs_control"] is not None
            and r["pass1_vs_control"] >= -MAX_PASS1_COST
            and r["wall_s"] <= MAX_WALL_S
        )


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def table(rows: list[dict]) -> list[str]:
    out = [
        "| variant | seed | pass@1 | gain pass@1 | gain pass@8 | pass@1 - control | maj@8 "
        "| Self-PRM@8 | Self-PRM@8 - maj@8 (paired) | AUC within a problem | precision, "
        "hardest tercile | self-confidence@8 - maj@8 (paired) | its AUC within | wall "
        "| target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = r.get("final", {})
        auc = f.get("judge_auc_within")
        hard = f.get("hard_precision")
        conf = f.get("conf_auc_within")
        target = "control" if is_control(r) else ("met" if r.get("met") else "**missed**")
        if "error" in r:
            target += f" ({r['error']})"
        if r.get("note"):
            target += f"; {r['note']}"
        cost = r.get("pass1_vs_control")
        out.append(
            f"| {r['variant']} | {r['seed']} | {_ci(f.get('pass@1'))} "
            f"| {_gain(r.get('gain_pass@1'))} | {_gain(r.get('gain_pass@8'))} "
            f"| {_num(None if cost is None else 100 * cost, '{:+.1f}')} "
            f"| {_ci(f.get(f'maj@{K}'))} | {_ci(f.get(f'self_prm@{K}'))} "
            f"| {_gain(f.get(f'self_prm_vs_maj@{K}'))} | {_num(auc and auc['mean'], '{:.2f}')} "
            f"| {_num(hard, '{:.2f}')} | {_gain(f.get(f'self_conf_vs_maj@{K}'))} "
            f"| {_num(conf and conf['mean'], '{:.2f}')} | {r['wall_s'] / 60:.1f} min | {target} |"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=f"w0.25,{CONTROL}")
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/selfprm.md"))
    parser.add_argument("--fresh", action="store_true", help="drop the rows already in --out")
    parser.add_argument(
        "--add", action="append", default=[], help="VARIANT:SEED:RUN:WALL_S:NOTE, a run by hand"
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides of every variant")
    args = parser.parse_args()
    raw = Path(args.out).with_suffix(".json")
    rows = [] if args.fresh or not raw.is_file() else json.loads(raw.read_text())
    verdicts(rows)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    recipe = " ".join([args.config, *args.overrides])
    names = [n for n in args.variants.split(",") if n]
    for name in names:
        if name not in VARIANTS:
            parser.error(f"--variants: {name!r} is not one of {sorted(VARIANTS)}")

    def record(row: dict) -> None:
        nonlocal rows
        row["era"] = ERA
        same = (row["variant"], row["seed"], era_of(row), recipe_of(row))
        rows = [r for r in rows if (r["variant"], r["seed"], era_of(r), recipe_of(r)) != same]
        rows.append(row)
        verdicts(rows)

    def write() -> None:
        lines = [
            "# Self-PRM without the price (issue 41)",
            "",
            f"`python benchmarks/selfprm.py` ({cpu_name()}, {os.cpu_count()} cores): each "
            "row is `rlax demo --config CONFIG seed=S` plus the recipe's overrides (the "
            "section's title) and the variant's, timed from start to exit, on an otherwise "
            "idle machine unless its note says so. Final version against the seed's SFT "
            "base (v0); 95% "
            "bootstrap intervals over problems, paired for differences.",
            "",
            "Variants: "
            + "; ".join(f"`{n}`: {d} ({' '.join(o) or '-'})" for n, (d, o) in VARIANTS.items()),
            "",
            f"Target per seed: Self-PRM@{K} - maj@{K} with its interval above 0, pass@1 "
            f"within {100 * MAX_PASS1_COST:.0f} points of `{CONTROL}` on the same recipe and "
            f"seed, <= {MAX_WALL_S / 60:.0f} min.",
        ]
        sections = [(f"Control (`{CONTROL}`: no judging code runs)", None)]
        sections += [(f"Era {e}: {ERAS[e]}", e) for e in sorted(ERAS, key=lambda e: e != ERA)]
        for recipe in sorted({recipe_of(r) for r in rows}):
            lines += ["", f"## Recipe `{recipe}`"]
            for title, era in sections:
                mine = [r for r in rows if era_of(r) == era and recipe_of(r) == recipe]
                if mine:
                    by = sorted(mine, key=lambda r: (r["variant"], r["seed"]))
                    lines += ["", f"### {title}", "", *table(by)]
        # The reading of the table, written by hand below READING, survives a rerun.
        out = Path(args.out)
        text = out.read_text() if out.is_file() else ""
        if READING in text:
            lines += ["", READING + text.split(READING, 1)[1].rstrip("\n")]
        write_results(args.out, lines, rows)

    for spec in args.add:
        name, seed, url, wall, note = spec.split(":", 4)
        if name not in VARIANTS:
            parser.error(f"--add: variant {name!r} is not one of {sorted(VARIANTS)}")
        run = Run.open(url)
        row = seed_row(run, int(seed), float(wall), 0)
        row.pop("passed", None)
        row.update(judging(run))
        row.update(variant=name, config=args.config, recipe=recipe, note=note)
        row.update(date=time.strftime("%Y-%m-%d"))
        record(row)
    write()
    for name in names:
        for seed in (int(s) for s in args.seeds.split(",")):
            row = run_local_seed(
                f"selfprm-{name}",
                args.config,
                seed,
                stamp,
                [*args.overrides, *VARIANTS[name][1]],
                judging,
            )
            row.update(variant=name, config=args.config, recipe=recipe)
            row.update(date=time.strftime("%Y-%m-%d"))
            record(row)
            write()
    return 0 if any(r.get("met") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
