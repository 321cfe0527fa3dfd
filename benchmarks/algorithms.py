"""Every RL algorithm preset on the demo task with the same budget, and the sampler/trainer
numerical-alignment study (float32 vs bfloat16 sampling).

Each algorithm runs `configs/algorithms/<name>.yaml` (the demo run) from one shared SFT'd
base model, with the same budget overrides (steps, batch size, learning rate, evaluation
size). The trainer and one rollout worker run as threads of this process (the demo runs
them as processes; the protocol through the run directory is the same), sharing compiled
programs across algorithms; held-out pass@1 is measured every `--eval-every` versions on
the same problems with the same sampling keys.

    .venv/bin/python benchmarks/algorithms.py [--steps 12] [--prompts 16] [--algorithms all]
    .venv/bin/python benchmarks/algorithms.py --only-alignment

Writes benchmarks/results/algorithms.md and algorithms.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pipeline.config import ALGORITHMS, RunConfig, TrainerConfig, load_config
from pipeline.problem_sets import write_data
from pipeline.run import Run, base_server
from pipeline.tokenizer.run import run_tokenizer
from tpu_jobs.evaluator import Evaluator
from tpu_jobs.generate.static_sampler import StaticSampler
from tpu_jobs.learning.step import Learner
from tpu_jobs.model.transformer import load_flat_params, param_count
from tpu_jobs.rollout_worker import RolloutWorker
from tpu_jobs.sft import train_sft
from tpu_jobs.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def budget_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"trainer.steps={args.steps}",
        f"trainer.lr={args.lr}",
        f"trainer.warmup_steps={min(5, max(1, args.steps // 4))}",
        f"trainer.checkpoint_every={args.steps}",
        f"rollout.prompts_per_batch={args.prompts}",
        f"sampler.max_new_tokens={args.max_new_tokens}",
        f"rollout.group_size={args.group}",
        f"sft.steps={args.sft_steps}",
        f"eval.num_problems={args.eval_problems}",
        f"eval.num_samples={args.eval_samples}",
        f"eval.ks=[1,{args.eval_samples}]",
        "eval.bootstrap=200",
        f"storage.root={args.root}",
    ]


def copy_run(src: Run, url: str, cfg: RunConfig) -> Run:
    shutil.rmtree(url, ignore_errors=True)
    dst = Run.create(url, cfg)
    for prefix in ("data/", "base/"):
        for key in src.store.list(prefix):
            dst.store.write_new(key, src.store.read(key))
    return dst


def prepare_base(args: argparse.Namespace, log) -> Run:
    """The demo task's data and SFT'd base model, made once and reused."""
    cfg = load_config(ROOT / "configs/demo.yaml", budget_overrides(args))
    url = str(Path(args.root) / "base")
    if Path(url, "base").exists():
        run = Run.open(url)
        log(f"[bench] reusing the base model in {url}")
        return run
    shutil.rmtree(url, ignore_errors=True)
    if args.base_from:  # an existing demo run's data and SFT'd base (same model/task/SFT)
        src = Run.open(args.base_from)
        for section in ("model", "task", "sft"):
            if getattr(src.config, section) != getattr(cfg, section):
                raise SystemExit(f"--base-from {args.base_from}: its {section} config differs")
        log(f"[bench] base model and data from {args.base_from}")
        return copy_run(src, url, cfg)
    run = Run.create(url, cfg)
    t0 = time.time()
    write_data(run)
    train_sft(run)
    log(f"[bench] SFT base model in {time.time() - t0:.0f}s")
    return run


class Shared:
    """One sampler (and its compiled programs) for every worker and evaluator."""

    def __init__(self, base: Run) -> None:
        tok = run_tokenizer(base)
        self.sampler = StaticSampler(base.config.model, pad_id=tok.pad_id, eos_id=tok.eos_id)
        self.v0_eval: dict[str, Any] | None = None


def evaluate(run: Run, shared: Shared, version: int) -> dict[str, Any]:
    if version == 0 and shared.v0_eval is not None:
        return shared.v0_eval  # every run starts from the same base: same samples
    ev = Evaluator(run, log=lambda m: None)
    ev.sampler = shared.sampler
    record = ev.evaluate(version)
    if version == 0:
        shared.v0_eval = record
    return record


def run_algorithm(name: str, base: Run, shared: Shared, args, log) -> dict[str, Any]:
    cfg = load_config(ROOT / "configs/algorithms" / f"{name}.yaml", budget_overrides(args))
    return train_run(name, cfg, base, shared, args, log)


def train_run(name: str, cfg: RunConfig, base: Run, shared: Shared, args, log) -> dict[str, Any]:
    """Trainer + worker threads on a copy of the base run, then held-out evaluations."""
    run = copy_run(base, str(Path(args.root) / name), cfg)
    trainer = Trainer(run, log=lambda m: None)
    worker = RolloutWorker(run, "w0", log=lambda m: None)
    worker.sampler = shared.sampler
    errors: list[BaseException] = []

    def train() -> None:
        try:
            trainer.train()
        except BaseException as err:  # surface it in the main thread
            errors.append(err)
            worker.request_stop()

    t0 = time.time()
    thread = threading.Thread(target=train, name=f"trainer-{name}")
    thread.start()
    worker.run_forever()
    thread.join()
    wall = time.time() - t0
    if errors:
        raise errors[0]
    train_records = sorted(run.read_metrics("train"), key=lambda r: r["step"])
    attempts = [json.loads(run.store.read(k)) for k in run.store.list("metrics/rollout/")]
    versions = sorted({0, *range(args.eval_every, args.steps + 1, args.eval_every), args.steps})
    evals = {v: evaluate(run, shared, v) for v in versions}
    step_compute = [r["step_s"] - r["wait_s"] for r in train_records[1:]]
    result = {
        "name": name,
        "wall_s": wall,
        "trainer_s_per_step": statistics.median(step_compute) if step_compute else float("nan"),
        "rollout_s_per_batch": statistics.median(a["seconds"] for a in attempts[1:] or attempts),
        "rollout_tokens": int(sum(a["tokens"] for a in attempts)),
        "pass1": {v: evals[v]["metrics"]["pass@1"] for v in versions},
        "reward_first": float(np.mean([r["reward_mean"] for r in train_records[:3]])),
        "reward_last": float(np.mean([r["reward_mean"] for r in train_records[-3:]])),
        "dropped": int(train_records[-1]["dropped_total"]) if train_records else 0,
        "clip_frac": float(np.mean([r.get("clip_frac", 0.0) for r in train_records])),
        "is_ratio_max": float(max(r["is_ratio_max"] for r in train_records)),
        "ds_dropped_groups": int(sum(r.get("ds_dropped_groups", 0) for r in train_records)),
        "groups_mean": float(np.mean([r["groups"] for r in train_records])),
        "loss_finite": all(np.isfinite(r["loss"]) for r in train_records),
        "absdiff_mean": float(np.mean([r["logprob_absdiff_mean"] for r in train_records])),
    }
    log(
        f"[bench] {name}: pass@1 "
        + " ".join(f"v{v}={p['mean']:.3f}" for v, p in result["pass1"].items())
        + f" wall {wall:.0f}s"
    )
    return result


# --------------------------------------------------------------------------------------
# Alignment: float32 vs bfloat16 sampling, recomputed vs stored log-probs
# --------------------------------------------------------------------------------------


def alignment_study(base: Run, shared: Shared, args, log) -> dict[str, Any]:
    """Sample the base model's first batches in float32 and bfloat16; score the same tokens
    in the trainer (float32 recomputation) with the ratio anchored at the sampler's
    log-probs ("behaviour") or at the recomputation ("recompute", + TIS)."""
    cfg = load_config(ROOT / "configs/algorithms/grpo.yaml", budget_overrides(args))
    cfg = replace(cfg, trainer=cfg.trainer.replace(kl_coef=0.0, max_staleness=0))
    run = copy_run(base, str(Path(args.root) / "alignment"), cfg)
    trainer = Trainer(run, log=lambda m: None)
    worker = RolloutWorker(run, "w0", log=lambda m: None)
    worker.sampler = shared.sampler
    load_flat_params(worker.model, base_server(run).pull(0).tensors)
    base_params = trainer._base_params()
    batches: dict[str, list] = {}
    for dtype in ("float32", "bfloat16"):
        worker.cfg = replace(cfg, sampler=replace(cfg.sampler, dtype=dtype))
        batches[dtype] = [worker.generate_batch(i, 0) for i in range(args.alignment_batches)]

    def learner(**changes) -> Learner:
        # A fresh trainer section: only the preset, the anchor and the IS correction.
        tc = TrainerConfig().replace(
            steps=args.steps, lr=args.lr, kl_coef=0.0, is_cap=2.0, **changes
        )
        return Learner(replace(cfg, trainer=tc), trainer.prompt_len, fused=False)

    out: dict[str, Any] = {"drift": {}, "anchors": [], "grads": []}
    probe = learner(is_correction="none")
    params = probe.init_params(base_params)
    for dtype, bs in batches.items():
        diffs = []
        for b in bs:
            inp = probe.inputs(b)
            logp = np.asarray(probe.programs.forward(params, inp.tokens, inp.mask)[0])
            diffs.append(np.abs(logp - inp.logp_behaviour)[inp.comp_mask > 0])
        d = np.concatenate(diffs)
        out["drift"][dtype] = {
            "tokens": int(d.size),
            "mean": float(d.mean()),
            "p99": float(np.quantile(d, 0.99)),
            "max": float(d.max()),
            "ratio_dev_max": float(np.max(np.abs(np.expm1(d)))),
        }
    settings = [
        ("grpo", "behaviour", "none"),
        ("grpo", "recompute", "none"),
        ("grpo", "recompute", "tis"),
        ("gspo", "behaviour", "none"),
        ("gspo", "recompute", "tis"),
        ("cispo", "behaviour", "none"),
        ("cispo", "recompute", "tis"),
    ]
    for alg, anchor, isc in settings:
        ln = learner(algorithm=alg, old_logprobs=anchor, is_correction=isc)
        p = ln.init_params(base_params)
        for dtype, bs in batches.items():
            rows = []
            for b in bs:
                _, m = ln._grads(p, ln.inputs(b), None, None, None)
                rows.append({k: float(v) for k, v in jax.device_get(m).items()})
            out["anchors"].append(
                {
                    "algorithm": alg,
                    "anchor": anchor,
                    "is": isc,
                    "sampler": dtype,
                    "clip_frac": float(np.mean([r["clip_frac"] for r in rows])),
                    "ratio_min": float(min(r["ratio_min"] for r in rows)),
                    "ratio_max": float(max(r["ratio_max"] for r in rows)),
                    "is_weight_mean": float(np.mean([r.get("is_weight_mean", 1.0) for r in rows])),
                    "is_ratio_min": float(min(r["is_ratio_min"] for r in rows)),
                    "is_ratio_max": float(max(r["is_ratio_max"] for r in rows)),
                    "is_frac_over_cap": float(np.mean([r["is_ratio_frac_over_cap"] for r in rows])),
                }
            )
    # Gradients on the bf16 samples vs the float32-consistent gradient of the same samples
    # (pi_old = pi_behaviour = the trainer's float32 policy: exactly what a float32 sampler
    # producing these tokens would give).
    for alg in ("grpo", "gspo"):
        ref_l = learner(algorithm=alg, old_logprobs="recompute", is_correction="none")
        p = ref_l.init_params(base_params)
        variants = {
            "stored bf16 log-probs as pi_old": learner(
                algorithm=alg, old_logprobs="behaviour", is_correction="none"
            ),
            "recomputed pi_old + TIS (C=2)": learner(
                algorithm=alg, old_logprobs="recompute", is_correction="tis"
            ),
        }
        for label, ln in variants.items():
            cos, rel = [], []
            for b in batches["bfloat16"]:
                g_ref, _ = ref_l._grads(p, ref_l.inputs(b), None, None, None)
                g, _ = ln._grads(p, ln.inputs(b), None, None, None)
                a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g_ref)])
                c = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
                cos.append(float(a @ c / (np.linalg.norm(a) * np.linalg.norm(c) + 1e-30)))
                rel.append(float(np.linalg.norm(c - a) / (np.linalg.norm(a) + 1e-30)))
            out["grads"].append(
                {"algorithm": alg, "variant": label, "cos": min(cos), "rel_err": max(rel)}
            )
    log(f"[bench] alignment: {json.dumps(out['drift'])}")
    return out


def alignment_training(base: Run, shared: Shared, args, log) -> list[dict[str, Any]]:
    """GSPO trained with a bfloat16 sampler: stored vs recomputed pi_old, and float32."""
    results = []
    for label, dtype, anchor, isc in (
        ("float32 sampler", "float32", "recompute", "tis"),
        ("bf16 sampler, stored log-probs as pi_old", "bfloat16", "behaviour", "none"),
        ("bf16 sampler, recomputed pi_old + TIS", "bfloat16", "recompute", "tis"),
    ):
        over = budget_overrides(args) + [
            f"sampler.dtype={dtype}",
            f"trainer.old_logprobs={anchor}",
            f"trainer.is_correction={isc}",
        ]
        cfg = load_config(ROOT / "configs/algorithms/gspo.yaml", over)
        r = train_run(f"gspo-{dtype}-{anchor}", cfg, base, shared, args, log)
        results.append({"label": label, **r})
    return results


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def write_report(args, base: Run, results, align, align_train, seconds: float) -> None:
    cfg = base.config
    lines = [
        "# RL algorithms on the demo task",
        "",
        "Every preset of `pipeline/algorithms.PRESETS`, run from `configs/algorithms/<name>.yaml`"
        " (the demo run: demo model "
        f"{param_count(cfg.model):,} parameters, arithmetic + countdown, SFT'd on a noisy teacher; "
        "max_staleness 1 with TIS, C = 2) from one shared base model, **with a reduced budget** "
        f"(the full demo takes minutes per algorithm on this shared 2-core machine): "
        f"{args.steps} RL steps of {args.prompts} prompts x G = {args.group} samples of up to "
        f"{args.max_new_tokens} tokens, lr {args.lr:g}; held-out pass@1 on {args.eval_problems} "
        f"problems x {args.eval_samples} samples (same keys for every algorithm) every "
        f"{args.eval_every} versions. Trainer and one rollout worker run as threads of one "
        "process; wall time covers the RL steps (rollouts + training, compilation included: "
        "programs are shared between algorithms, so later algorithms compile less).",
        "",
        f"Device: {jax.devices()[0].platform}, {os.cpu_count()} visible CPUs, "
        f"{platform.machine()}, JAX {jax.__version__}; machine shared with other jobs. "
        f"Total benchmark time {seconds / 60:.0f} min.",
        "",
    ]
    if results:
        versions = sorted(results[0]["pass1"])
        head = " | ".join(f"pass@1 v{v}" for v in versions)
        lines += [
            "## Held-out pass@1 per version and cost",
            "",
            f"| algorithm | {head} | final 95% CI | batch reward first 3 -> last 3 steps "
            "| wall (s) | trainer s/step | rollout s/batch | rollout tokens | mean clip frac "
            "| notes |",
            "|---|" + "---:|" * len(versions) + "---|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in results:
            last = r["pass1"][versions[-1]]
            notes = []
            if TrainerConfig(algorithm=r["name"]).uses_dynamic_sampling():  # the preset's
                notes.append(
                    f"dynamic sampling dropped {r['ds_dropped_groups']} groups; "
                    f"{r['groups_mean']:.1f} groups/batch"
                )
            if r["dropped"]:
                notes.append(f"{r['dropped']} batches dropped")
            if not r["loss_finite"]:
                notes.append("NON-FINITE LOSS")
            lines.append(
                f"| {r['name']} | "
                + " | ".join(f"{r['pass1'][v]['mean']:.3f}" for v in versions)
                + f" | [{last['lo']:.3f}, {last['hi']:.3f}] | {r['reward_first']:.3f} -> "
                f"{r['reward_last']:.3f} | {r['wall_s']:.0f} | {r['trainer_s_per_step']:.2f} "
                f"| {r['rollout_s_per_batch']:.2f} | {r['rollout_tokens']:,} | "
                f"{r['clip_frac']:.4f} | {'; '.join(notes)} |"
            )
        lines += ["", "![pass@1 per version](algorithms.png)", ""]
    if align:
        d = align["drift"]
        lines += [
            "## Trainer-sampler numerical alignment (float32 vs bfloat16 sampling)",
            "",
            f"The SFT'd demo base model samples its first {args.alignment_batches} batches "
            f"({args.prompts} prompts x {args.group}) twice, with the sampler computing in "
            "float32 and in bfloat16 (`sampler.dtype`); the trainer recomputes the log-probs of "
            "the same tokens in float32 (`Learner.programs.forward`, the trainer's own pass).",
            "",
            "| sampler dtype | completion tokens | mean abs(dlogp) | p99 | max | max abs(ratio - 1) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for dtype, s in d.items():
            lines.append(
                f"| {dtype} | {s['tokens']:,} | {s['mean']:.2e} | {s['p99']:.2e} | "
                f"{s['max']:.2e} | {s['ratio_dev_max']:.2e} |"
            )
        lines += [
            "",
            "First update of each batch (no step taken yet, so any ratio != 1 is an artefact "
            "of the anchor): `behaviour` = the stored sampler log-probs are pi_old (what a "
            "trainer that trusts the sampler does); `recompute` = pi_old is the trainer's "
            "recomputation, the sampler mismatch goes into the TIS weight "
            "min(pi_old / pi_sampler, 2).",
            "",
            "| algorithm (clip range) | sampler | pi_old | IS | clip fraction | ratio min | ratio "
            "max | pi_old / pi_sampler min - max | mean IS weight |",
            "|---|---|---|---|---:|---:|---:|---|---:|",
        ]
        eps = {"grpo": "0.2 / 0.2", "gspo": "3e-4 / 4e-4", "cispo": "IS weight <= 1.28"}
        for a in align["anchors"]:
            lines.append(
                f"| {a['algorithm']} ({eps[a['algorithm']]}) | {a['sampler']} | {a['anchor']} | "
                f"{a['is']} | {a['clip_frac']:.4f} | {a['ratio_min']:.4f} | "
                f"{a['ratio_max']:.4f} | {a['is_ratio_min']:.3f} - {a['is_ratio_max']:.3f} | "
                f"{a['is_weight_mean']:.4f} |"
            )
        lines += [
            "",
            "Gradient of the first update on the bfloat16 samples, compared with the "
            "float32-consistent gradient of the same samples (pi_old = the trainer's float32 "
            "policy, no IS weight: the gradient a float32 sampler emitting these tokens would "
            "give). Worst batch shown.",
            "",
            "| algorithm | pi_old | cosine to float32-consistent | relative error |",
            "|---|---|---:|---:|",
        ]
        for g in align["grads"]:
            lines.append(
                f"| {g['algorithm']} | {g['variant']} | {g['cos']:.4f} | {g['rel_err']:.3f} |"
            )
        lines.append("")
    if align_train:
        lines += [
            "### Training with a bfloat16 sampler (GSPO)",
            "",
            f"GSPO, same budget ({args.steps} steps), held-out pass@1 after the last step:",
            "",
            "| run | pass@1 final [95% CI] | mean clip fraction | mean abs(dlogp) "
            "| batch reward last 3 |",
            "|---|---|---:|---:|---:|",
        ]
        for r in align_train:
            p = r["pass1"][max(r["pass1"])]
            lines.append(
                f"| {r['label']} | {p['mean']:.3f} [{p['lo']:.3f}, {p['hi']:.3f}] | "
                f"{r['clip_frac']:.4f} | {r['absdiff_mean']:.2e} | {r['reward_last']:.3f} |"
            )
        lines.append("")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "algorithms.md").write_text("\n".join(lines))
    (RESULTS / "algorithms.json").write_text(
        json.dumps(
            {
                "results": results,
                "alignment": align,
                "alignment_training": align_train,
                "seconds": seconds,
            },
            indent=1,
            default=str,
        )
    )
    if results:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in results:
            vs = sorted(r["pass1"])
            ax.plot(vs, [r["pass1"][v]["mean"] for v in vs], marker="o", label=r["name"])
        ax.set_xlabel("policy version (= RL step)")
        ax.set_ylabel("held-out pass@1")
        ax.set_title(f"demo task, {args.steps} steps x {args.prompts} prompts x G={args.group}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(RESULTS / "algorithms.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=8e-5)
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=96,
        help="96: long enough for the 6-digit worked solutions (64 truncates many)",
    )
    ap.add_argument("--sft-steps", type=int, default=600)
    ap.add_argument("--eval-problems", type=int, default=200)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--algorithms", default="all", help="comma-separated, or all")
    ap.add_argument("--alignment-batches", type=int, default=4)
    ap.add_argument("--only-alignment", action="store_true")
    ap.add_argument("--no-alignment", action="store_true")
    ap.add_argument("--alignment-training", action="store_true", help="also train GSPO 3 ways")
    ap.add_argument("--root", default=str(ROOT / "runs" / "bench-algorithms"))
    ap.add_argument(
        "--base-from", default="", help="copy data/ and base/ of this run instead of SFT"
    )
    args = ap.parse_args()

    def log(m: str) -> None:
        print(m, flush=True)

    t0 = time.time()
    base = prepare_base(args, log)
    shared = Shared(base)
    names = list(ALGORITHMS) if args.algorithms == "all" else args.algorithms.split(",")
    previous: dict[str, Any] = {}
    if args.only_alignment and (RESULTS / "algorithms.json").exists():
        previous = json.loads((RESULTS / "algorithms.json").read_text())  # keep those tables
        for r in (previous.get("results") or []) + (previous.get("alignment_training") or []):
            r["pass1"] = {int(v): p for v, p in r["pass1"].items()}  # JSON made keys strings
    results = previous.get("results") or []
    if not args.only_alignment:
        for name in names:
            results.append(run_algorithm(name, base, shared, args, log))
    align = None if args.no_alignment else alignment_study(base, shared, args, log)
    align_train = previous.get("alignment_training")
    if args.alignment_training:
        align_train = alignment_training(base, shared, args, log)
    seconds = time.time() - t0 + previous.get("seconds", 0.0)
    write_report(args, base, results, align, align_train, seconds)
    print((RESULTS / "algorithms.md").read_text())


if __name__ == "__main__":
    main()
