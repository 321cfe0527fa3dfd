"""Trainer throughput and model FLOPs utilisation for the `100m` preset.

One trainer step = `Learner.step` (GRPO: the trainer's default chain of programs: forward
+ VJP of the model, loss head, backward, AdamW update; with and without the KL term's
reference forward; for comparison also `trainer.fused_step`, everything in one jitted
program) on a synthetic batch of `rows` sequences of `seq` tokens (prompt `seq // 4`,
completion the rest; every token real). The variants are compiled first, then timed
round-robin (step after step), so that all of them see the same load on the shared
machine. Tokens/s counts all tokens of
the batch (the forward and backward run over prompt and completion alike).

FLOPs per step (PaLM's MFU convention): 6 * N * tokens for the weight matmuls (forward 2N,
backward 4N) plus 12 * layers * seq * (heads * head_dim) per token for attention scores and
values (full T x T: masked attention computes them all), N = all parameters. The peak is
measured in the same process: the best float32 throughput of a jitted square matmul
(`x @ y`, 2 n^3 FLOPs) over a few sizes, measured before and after the trainer steps (the
machine is shared: the larger of the two measurements is used).

    .venv/bin/python benchmarks/trainer.py [--rows 8] [--seq 256] [--steps 3]

Writes benchmarks/results/trainer.md (and trainer.png).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pipeline.config import load_config
from tpu_jobs.learning.step import Learner, StepInputs
from tpu_jobs.model.transformer import param_count

RESULTS = Path(__file__).parent / "results"


def matmul_peak(sizes=(1024, 2048, 3072), repeats: int = 3) -> dict[int, tuple[float, float]]:
    """{n: (FLOP per wall second, FLOP per CPU second)} of a jitted float32 n x n matmul,
    the best of `repeats` calls each."""
    out = {}
    f = jax.jit(lambda a, b: a @ b)
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        f(a, b).block_until_ready()
        wall = cpu = float("inf")
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            f(a, b).block_until_ready()
            wall = min(wall, time.perf_counter() - t0)
            cpu = min(cpu, time.process_time() - c0)
        out[n] = (2 * n**3 / wall, 2 * n**3 / cpu)
    return out


def make_learner(rows: int, seq: int, kl: bool, fused: bool = False):
    group = 4 if rows % 4 == 0 else 1
    prompt = seq // 4
    cfg = load_config(
        None,
        [
            "model.preset=100m",
            f"model.max_seq_len={seq}",
            f"sampler.max_new_tokens={seq - prompt}",
            f"rollout.prompts_per_batch={rows // group}",
            f"rollout.group_size={group}",
            "trainer.algorithm=grpo",
            f"trainer.kl_coef={0.04 if kl else 0.0}",
            "trainer.steps=100",
        ],
    )
    return cfg, Learner(cfg, prompt, fused=fused)


def synthetic_inputs(learner: Learner, rows: int, seq: int, vocab: int) -> StepInputs:
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, vocab, (rows, seq)).astype(np.int32)
    mask = np.ones((rows, seq), np.int32)
    comp = np.ones((rows, learner.completion_len), np.float32)
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    rewards[:: learner.group_size] = 1.0 - rewards[1 :: learner.group_size]  # no constant group
    logp_b = -rng.uniform(0.5, 4.0, comp.shape).astype(np.float32)
    return StepInputs(tokens, mask, comp, logp_b, rewards)


class Variant:
    def __init__(self, rows: int, seq: int, kl: bool, fused: bool) -> None:
        self.rows, self.seq, self.kl, self.fused = rows, seq, kl, fused
        self.cfg, self.learner = make_learner(rows, seq, kl, fused)
        self.inp = synthetic_inputs(self.learner, rows, seq, self.cfg.model.vocab_size)
        self.state = self.learner.template
        params = self.state[0]
        self.ref = jax.tree.map(jnp.copy, params["policy"]) if kl else None
        self.walls: list[float] = []
        self.cpus: list[float] = []
        self.first = self.step(record=False)

    def step(self, record: bool = True) -> float:
        t0, c0 = time.perf_counter(), time.process_time()
        p, o, _ = self.learner.step(*self.state, self.ref, self.inp)  # metrics fetched: sync
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        self.state = (p, o)
        if record:
            self.walls.append(wall)
            self.cpus.append(cpu)
        return wall

    def result(self) -> dict:
        m = self.cfg.model
        n = param_count(m)
        tokens = self.rows * self.seq
        attn = m.num_layers * self.seq * m.num_heads * m.head_dim * tokens
        flops = 6 * n * tokens + 12 * attn
        if self.kl:  # the reference model's forward pass
            flops += 2 * n * tokens + 4 * attn
        med, best, cpu = (
            statistics.median(self.walls),
            min(self.walls),
            statistics.median(self.cpus),
        )
        return dict(
            rows=self.rows,
            seq=self.seq,
            kl=self.kl,
            fused=self.fused,
            params=n,
            first=self.first,
            median=med,
            best=best,
            cpu_s=cpu,
            tok_s=tokens / med,
            flops=flops,
            flop_s=flops / med,
            best_flop_s=flops / best,
            flop_per_cpu_s=flops / cpu,
        )


def fmt_peak(peak: dict[int, tuple[float, float]]) -> str:
    return ", ".join(f"n={n}: {w / 1e9:.1f} ({c / 1e9:.1f}/CPU-s)" for n, (w, c) in peak.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-fused", action="store_true", help="skip the fused_step row")
    args = ap.parse_args()
    peaks = [matmul_peak()]
    print("peak:", fmt_peak(peaks[-1]), flush=True)
    kinds = [(False, False), (True, False)] + ([] if args.no_fused else [(False, True)])
    variants = []
    for kl, fused in kinds:
        variants.append(Variant(args.rows, args.seq, kl, fused))
        print(f"compiled kl={kl} fused={fused}: first step {variants[-1].first:.1f}s", flush=True)
    for i in range(args.steps):
        for v in variants:
            print(f"step {i} kl={v.kl} fused={v.fused}: {v.step():.2f}s", flush=True)
        peaks.append(matmul_peak())
        print("peak:", fmt_peak(peaks[-1]), flush=True)
    results = [v.result() for v in variants]
    peak_wall = max(w for p in peaks for w, _ in p.values())
    peak_cpu = max(c for p in peaks for _, c in p.values())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    n_params = param_count(make_learner(args.rows, args.seq, False)[0].model)
    lines = [
        "# Trainer throughput and MFU (`100m` preset)",
        "",
        f"One GRPO trainer step (`Learner.step`) on {args.rows} x {args.seq} tokens (prompt "
        f"{args.seq // 4}, completion {args.seq - args.seq // 4}; all tokens real), float32, "
        f"{n_params:,} parameters. Times are over {args.steps} steps after a first (compiling) "
        "step. FLOPs = 6 N tokens + 12 L T (heads x head_dim) tokens (attention; + the "
        "reference forward, 2 N tokens + 4 L T d tokens, when the KL term is on).",
        "",
        "Peak = the best jitted float32 square matmul (n = 1024, 2048, 3072) measured in the "
        "same run before the steps and after every round of steps. The machine is shared with other "
        "jobs (load average "
        f"{load:.1f} at the end, {os.cpu_count()} CPUs), so wall-clock rates swing by 2x "
        "between measurements. Two normalisations are reported: wall clock (trainer FLOP/s "
        "over the best wall-clock matmul FLOP/s seen; pessimistic, since the peak was caught in "
        "a quiet moment) and CPU time (FLOPs per CPU-second of this process, trainer vs "
        "matmul: insensitive to how many cores the other jobs left us).",
        "",
        f"Device: {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), "
        f"{platform.machine()}, JAX {jax.__version__}.",
        "",
        f"Matmul peak: {peak_wall / 1e9:.1f} GFLOP/s wall, {peak_cpu / 1e9:.1f} GFLOP per "
        "CPU-second. Measurements (GFLOP/s wall, per CPU-s): "
        + "; ".join(f"[{fmt_peak(p)}]" for p in peaks)
        + ".",
        "",
        "| step | KL ref | compile + first step (s) | median step (s) | best step (s) "
        "| tokens/s (median) | GFLOP/step | GFLOP/s (median) | fraction of peak, wall (median "
        "/ best step) | fraction of peak, CPU time |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        kind = (
            "trainer.fused_step=true (one program)"
            if r["fused"]
            else "default: chained programs (forward+VJP, loss head, backward, update)"
        )
        lines.append(
            f"| {kind} | {'on' if r['kl'] else 'off'} | {r['first']:.1f} | {r['median']:.2f} "
            f"| {r['best']:.2f} | {r['tok_s']:,.0f} | {r['flops'] / 1e9:,.0f} "
            f"| {r['flop_s'] / 1e9:.1f} | {r['flop_s'] / peak_wall:.0%} / "
            f"{r['best_flop_s'] / peak_wall:.0%} | {r['flop_per_cpu_s'] / peak_cpu:.0%} |"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "trainer.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [
        ("fused_step" if r["fused"] else "default") + (" +KL" if r["kl"] else "") for r in results
    ]
    x = np.arange(len(results))
    ax.bar(x - 0.27, [r["flop_s"] / peak_wall for r in results], 0.27, label="wall, median")
    ax.bar(x, [r["best_flop_s"] / peak_wall for r in results], 0.27, label="wall, best")
    ax.bar(x + 0.27, [r["flop_per_cpu_s"] / peak_cpu for r in results], 0.27, label="CPU time")
    ax.set_xticks(x, names)
    ax.axhline(0.4, color="k", ls="--", lw=0.8, label="40% target")
    ax.set_ylabel("fraction of matmul peak")
    ax.set_title(f"100m trainer step, {args.rows} x {args.seq} tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "trainer.png", dpi=120)
    print((RESULTS / "trainer.md").read_text())


if __name__ == "__main__":
    main()
