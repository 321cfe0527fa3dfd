"""Trainer MFU and sampler tokens/s on whatever JAX platform this runs on, in one command.

    .venv/bin/python benchmarks/accelerator.py            # GPU/TPU: 0.5b, 8 x 2048
    .venv/bin/python benchmarks/accelerator.py --shape 1.5b

Trainer: `Learner.step` (GRPO, the fused step) on random weights of a Qwen2.5 shape
(`tpu_jobs.learning.memory.QWEN25`), bf16 compute with float32 master weights, remat on
(`model.remat=full`), attention by platform (cuDNN flash attention on GPU, Pallas splash
attention on TPU (seq a multiple of 128), the chunked
path elsewhere), a synthetic batch of `rows` x `seq` tokens. MFU = model FLOPs per second
(PaLM's convention, as benchmarks/trainer.py: 6 N per token for the weights, 12 L T d per
token for attention; remat's recomputation is not counted) over the chip's peak:
the vendor's dense bf16 figure for a known device kind, else the best measured matmul
of this process, bf16 or float32 (the table says which). Sampler: `Sampler.generate` of `batch`
prompts of 256 tokens, `new` tokens each, no row stopping early.

On CPU the defaults shrink (rows 2, seq 512, batch 8, 32 new tokens), so the command
checks itself here in minutes; the GPU/TPU defaults fit a short loan (<8 minutes,
compiles included). Writes benchmarks/results/accelerator-<platform>.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from tpu_jobs.generate.interface import SamplingParams  # noqa: E402
from tpu_jobs.generate.static_sampler import StaticSampler  # noqa: E402
from tpu_jobs.learning.memory import QWEN25, shape_overrides  # noqa: E402
from tpu_jobs.learning.step import Learner, StepInputs  # noqa: E402
from tpu_jobs.model.transformer import init_model, param_count  # noqa: E402

# Dense bf16 peak FLOP/s per chip, from the vendors' data sheets, by jax device_kind.
PEAK_BF16 = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v4": 275e12,
    "TPU v6 lite": 918e12,
}
ATTENTION = {"gpu": "cudnn", "tpu": "splash"}  # else "chunked"
PROMPT = 256


def measured_peak(n: int = 4096, repeats: int = 5) -> float:
    """Best FLOP/s of a jitted n x n matmul on the default device, in bf16 or float32,
    whichever is faster (XLA:CPU runs some bf16 matmuls slower than float32 ones, and a
    peak below what the model's matmuls reach would give an MFU above 100%)."""
    f = jax.jit(lambda a, b: a @ b)
    best = float("inf")
    for dtype in (jnp.bfloat16, jnp.float32):
        a = jax.random.normal(jax.random.key(0), (n, n), dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), dtype)
        f(a, b).block_until_ready()
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def trainer_row(shape: str, rows: int, seq: int, steps: int, backend: str) -> dict:
    cfg = load_config(
        None,
        [
            *shape_overrides(shape),
            f"model.max_seq_len={seq}",
            "model.dtype=bfloat16",
            "model.remat=full",
            f"model.attention={ATTENTION.get(backend, 'chunked')}",
            f"sampler.max_new_tokens={seq - PROMPT}",
            "rollout.prompts_per_batch=1",
            f"rollout.group_size={rows}",
            "trainer.kl_coef=0.0",
            "trainer.fused_step=true",
        ],
    )
    learner = Learner(cfg, PROMPT)
    rng = np.random.default_rng(0)
    inp = StepInputs(
        rng.integers(4, cfg.model.vocab_size, (rows, seq)).astype(np.int32),
        np.ones((rows, seq), np.int32),
        np.ones((rows, learner.completion_len), np.float32),
        -rng.uniform(0.5, 4.0, (rows, learner.completion_len)).astype(np.float32),
        np.tile(np.array([0.0, 1.0], np.float32), rows // 2 + 1)[:rows],
    )
    state = learner.template
    t0 = time.perf_counter()
    state = learner.step(*state, None, inp)[:2]  # compile + first step
    first = time.perf_counter() - t0
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state = learner.step(*state, None, inp)[:2]  # metrics fetched: synchronised
        walls.append(time.perf_counter() - t0)
    m = cfg.model
    n = param_count(m)
    tokens = rows * seq
    flops = 6 * n * tokens + 12 * m.num_layers * seq * m.num_heads * m.head_dim * tokens
    med = statistics.median(walls)
    return dict(params=n, first_s=first, step_s=med, tok_s=tokens / med, flop_s=flops / med)


def sampler_row(shape: str, batch: int, new: int, repeats: int) -> dict:
    cfg = load_config(None, [*shape_overrides(shape), f"model.max_seq_len={PROMPT + new}"])
    model = init_model(cfg.model, 0)
    sampler = StaticSampler(cfg.model, eos_id=-1)  # -1 is never sampled: every row runs `new`
    rng = np.random.default_rng(0)
    vocab = cfg.model.vocab_size
    prompts = [rng.integers(4, vocab, PROMPT).tolist() for _ in range(batch)]

    def run(seed: int) -> float:
        keys = jax.random.split(jax.random.key(seed), batch)
        t0 = time.perf_counter()
        out = sampler.generate(
            model, prompts, keys, SamplingParams(max_new_tokens=new, dtype="bfloat16")
        )
        wall = time.perf_counter() - t0
        assert int(out.lengths.sum()) == batch * new, "a row stopped early"
        return wall

    first = run(0)
    med = statistics.median(run(i + 1) for i in range(repeats))
    return dict(first_s=first, wall_s=med, tok_s=batch * new / med)


def main(argv: list[str] | None = None) -> None:
    backend = jax.default_backend()
    small = backend == "cpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="0.5b", help=f"of {', '.join(QWEN25)}")
    parser.add_argument("--rows", type=int, default=2 if small else 8)
    parser.add_argument("--seq", type=int, default=512 if small else 2048)
    parser.add_argument("--steps", type=int, default=2 if small else 5)
    parser.add_argument("--batch", type=int, default=8 if small else 64)
    parser.add_argument("--new", type=int, default=32 if small else 512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    kind = device.device_kind
    peak, source = PEAK_BF16.get(kind), "data sheet (dense bf16)"
    if peak is None:
        peak, source = measured_peak(), "the best bf16 or float32 matmul of this process"
    t = trainer_row(args.shape, args.rows, args.seq, args.steps, backend)
    print("trainer", t, flush=True)
    s = sampler_row(args.shape, args.batch, args.new, 2)
    print("sampler", s, flush=True)
    mfu = t["flop_s"] / peak
    attention = ATTENTION.get(backend, "chunked")
    lines = [
        f"# Accelerator benchmark: {kind} ({backend})",
        "",
        f"`python benchmarks/accelerator.py --shape {args.shape} --rows {args.rows} --seq "
        f"{args.seq} --batch {args.batch} --new {args.new}` on {kind}, "
        f"{platform.machine()}, JAX {jax.__version__}. Random weights of the Qwen2.5-"
        f"{args.shape} shape ({t['params'] / 1e6:.0f}M parameters), bf16 compute, float32 "
        f"master weights, `model.remat=full`, `model.attention={attention}`. Peak "
        f"{peak / 1e12:.1f} TFLOP/s ({source}).",
        "",
        "| program | shape | tokens | first call s | median s | tokens/s | TFLOP/s | MFU |",
        "|---|---|---|---:|---:|---:|---:|---:|",
        f"| trainer step (GRPO, fused) | {args.shape} | {args.rows} x {args.seq} | "
        f"{t['first_s']:.1f} | {t['step_s']:.3f} | {t['tok_s']:,.0f} | "
        f"{t['flop_s'] / 1e12:.2f} | {100 * mfu:.1f}% |",
        f"| sampler (bf16) | {args.shape} | {args.batch} x ({PROMPT} + {args.new}) | "
        f"{s['first_s']:.1f} | {s['wall_s']:.3f} | {s['tok_s']:,.0f} | | |",
        "",
        "The goal on an H200 is a trainer MFU of at least 40% (the real-shapes issue).",
        "",
    ]
    out = Path(args.out or ROOT / f"benchmarks/results/accelerator-{backend}.md")
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
