"""Sampler throughput: generated tokens/s for the `demo` and `100m` presets.

Batch 64 x 64 new tokens, prompts of 16 random tokens, temperature 1, random-init
weights, no early stop (EOS id set to -1, which is never sampled). The first call
(compile + run) is reported separately; throughput is the median over timed calls.

    .venv/bin/python benchmarks/sampler.py [--presets demo,100m] [--repeats 3]

Writes the table to benchmarks/results/sampler.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from pipeline.config import ModelConfig
from tpu_jobs.generate.interface import SamplingParams
from tpu_jobs.generate.static_sampler import StaticSampler
from tpu_jobs.model.transformer import init_model, param_count

BATCH, NEW, PROMPT = 64, 64, 16
RESULTS = Path(__file__).parent / "results" / "sampler.md"


def bench(preset: str, repeats: int, dtype: str) -> dict:
    cfg = ModelConfig(preset=preset)
    model = init_model(cfg, seed=0)
    sampler = StaticSampler(cfg, eos_id=-1)  # -1 is never sampled: every row runs NEW steps
    rng = np.random.default_rng(0)
    prompts = [[1, *rng.integers(4, cfg.vocab_size, PROMPT - 1).tolist()] for _ in range(BATCH)]

    def run(seed: int) -> float:
        keys = jax.random.split(jax.random.key(seed), BATCH)
        start = time.perf_counter()
        out = sampler.generate(
            model, prompts, keys, SamplingParams(max_new_tokens=NEW, temperature=1.0, dtype=dtype)
        )
        elapsed = time.perf_counter() - start
        assert int(out.lengths.sum()) == BATCH * NEW, "a row stopped early"
        return elapsed

    first = run(0)
    times = [run(i + 1) for i in range(repeats)]
    assert sampler.compile_count == 1
    med = statistics.median(times)
    return dict(
        preset=preset,
        params=param_count(cfg),
        dtype=dtype,
        first=first,
        median=med,
        best=min(times),
        tok_s=BATCH * NEW / med,
        ms_step=1000 * med / NEW,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="demo,100m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()

    rows = []
    for preset in args.presets.split(","):
        r = bench(preset, args.repeats, args.dtype)
        rows.append(r)
        print(
            f"{preset}: {r['tok_s']:.0f} tok/s (compile+first call {r['first']:.1f}s)", flush=True
        )

    dev = jax.devices()[0]
    lines = [
        "# Sampler throughput",
        "",
        f"Batch {BATCH} x {NEW} new tokens, prompts of {PROMPT} tokens, temperature 1, "
        f"random-init weights, no early EOS, compute dtype {args.dtype}. Tokens/s counts "
        f"generated tokens only; time is the median of {args.repeats} calls of "
        "`Sampler.generate` (prefill + decode + host transfer), after a first call that "
        "compiles (reported separately).",
        "",
        f"Device: {dev.platform} ({dev.device_kind}), {os.cpu_count()} visible CPUs, "
        f"{platform.machine()}, JAX {jax.__version__}.",
        "",
        "| preset | params | compile + first call (s) | median call (s) | ms / decode step "
        "| tokens/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['params']:,} | {r['first']:.2f} | {r['median']:.3f} "
            f"| {r['ms_step']:.1f} | {r['tok_s']:,.0f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(table)


if __name__ == "__main__":
    main()
