"""Trainer step time on a ragged RL batch: sequence packing and rematerialisation.

One trainer step (`Learner.step`, GRPO, the default chain of programs) on a batch whose
completion lengths are long-tailed like the demo's sampled ones (the engine issue measured
median 47, max 301 of 512 new tokens on the `demo` preset): lengths drawn from a lognormal
with median 47, clipped to [1, max_new_tokens], prompts of 16-32 tokens. Variants, each
compiled first and then timed round-robin (step after step, so every variant sees the
same load on a shared machine):

* `padded` - the baseline: every row padded to prompt + max_new_tokens.
* `packed` (trainer.pack) - the rows' real tokens laid end to end in fewer rows.
* `remat full`, `remat dots` (model.remat) - the padded batch with each layer checkpointed:
  less memory, more compute (the backward recomputes the forward).

Each row also gives XLA's memory_analysis() temporaries of the variant's programs (the
forward + VJP program, the largest). Useful tokens/s counts real tokens only.

    .venv/bin/python benchmarks/packing.py [--preset demo] [--rows 64] [--steps 5]

Writes benchmarks/results/packing.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from tpu_jobs.learning.packing import pack  # noqa: E402
from tpu_jobs.learning.step import Learner, StepInputs  # noqa: E402
from tpu_jobs.model.batching import pack_rows  # noqa: E402

PROMPT = 32
VARIANTS: dict[str, list[str]] = {
    "padded": [],
    "packed": ["trainer.pack=true"],
    "remat full": ["model.remat=full"],
    "remat dots": ["model.remat=dots"],
}


def ragged_batch(rows: int, new: int, vocab: int, seed: int) -> StepInputs:
    """Random tokens; completion lengths lognormal with median 47 (the demo's measured
    long tail), prompts of 16-32 tokens; rewards random in {0, 1}."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(np.exp(rng.normal(np.log(47), 0.9, rows))), 1, new).astype(int)
    prompts = [rng.integers(3, vocab, rng.integers(16, PROMPT + 1)).tolist() for _ in range(rows)]
    completions = [rng.integers(3, vocab, n).tolist() for n in lengths]
    tokens, mask, comp_mask = pack_rows(prompts, completions, PROMPT, new)
    logp = np.where(comp_mask > 0, -2.0, 0.0).astype(np.float32)
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    return StepInputs(tokens, mask, comp_mask, logp, rewards)


def forward_memory(learner: Learner, params, inp: StepInputs) -> tuple[int, int]:
    """memory_analysis() (temporaries, outputs) of the variant's forward + VJP program:
    the outputs are mostly the residuals kept for the backward pass, which remat cuts."""
    packing = learner._pack(inp)
    with learner.under_mesh():
        lowered = learner.programs.forward_vjp.lower(params, inp.tokens, inp.mask, packing)
    m = lowered.compile().memory_analysis()
    return int(m.temp_size_in_bytes), int(m.output_size_in_bytes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new", type=int, default=512, help="max new tokens per row")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/packing.md"))
    args = parser.parse_args(argv)

    base = [
        f"model.preset={args.preset}",
        f"model.max_seq_len={PROMPT + args.new}",
        f"sampler.max_new_tokens={args.new}",
        f"rollout.prompts_per_batch={args.rows // 8}",
        "rollout.group_size=8",
        "trainer.kl_coef=0",  # no reference forward: the policy's step alone
    ]
    cfgs = {name: load_config(None, [*base, *extra]) for name, extra in VARIANTS.items()}
    vocab = cfgs["padded"].model.vocab_size
    inp = ragged_batch(args.rows, args.new, vocab, args.seed)
    real = int(inp.mask.sum())
    packed_rows = pack(inp.tokens, inp.mask, args.new).tokens.shape[0]

    learners, states, temps = {}, {}, {}
    for name, cfg in cfgs.items():
        t0 = time.perf_counter()
        learner = Learner(cfg, PROMPT)
        params, opt = learner.init_state(learner.template[0]["policy"])
        temps[name] = forward_memory(learner, params, inp)
        params, opt, _ = learner.step(params, opt, None, inp)  # compiles
        jax.block_until_ready(params)
        learners[name], states[name] = learner, (params, opt)
        print(f"{name}: compiled and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)

    times: dict[str, list[float]] = {name: [] for name in cfgs}
    losses: dict[str, float] = {}
    for step in range(args.steps):
        for name, learner in learners.items():
            # Each variant goes on from its own state; all start from the same weights and
            # take the same updates up to float rounding, so their losses stay comparable.
            params, opt = states[name]
            t0 = time.perf_counter()
            params, opt, metrics = learner.step(params, opt, None, inp)
            jax.block_until_ready(params)
            times[name].append(time.perf_counter() - t0)
            losses[name] = metrics["loss"]
            states[name] = (params, opt)
        print(f"step {step + 1}/{args.steps}: " + ", ".join(
            f"{n} {t[-1]:.2f} s" for n, t in times.items()), flush=True)  # fmt: skip

    base_t = statistics.median(times["padded"])
    lines = [
        "# Trainer step on a ragged batch: packing and rematerialisation",
        "",
        f"`python benchmarks/packing.py --preset {args.preset} --rows {args.rows} --new "
        f"{args.new} --steps {args.steps}` on {platform.machine()}, {os.cpu_count()} CPUs, "
        f"JAX {jax.__version__}, one CPU device. GRPO, the default chain of programs. "
        f"{args.rows} rows of {PROMPT} + {args.new} positions; {real} real tokens "
        f"({real / inp.mask.size:.0%} of the padded batch); packed into {packed_rows} rows. "
        "Median step time of the timed steps (round-robin, after a compiling step); "
        "temporaries and outputs (the residuals the backward pass reads) of the forward + "
        "VJP program from memory_analysis().",
        "",
        "| variant | step s (median) | vs padded | useful tokens/s | forward+VJP temporaries MiB | residuals for the backward MiB | loss after the steps |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in cfgs:
        t = statistics.median(times[name])
        lines.append(
            f"| {name} | {t:.3f} | {base_t / t:.2f}x | {real / t:,.0f} | "
            f"{temps[name][0] / 2**20:,.0f} | {temps[name][1] / 2**20:,.0f} | "
            f"{losses[name]:.4e} |"
        )
    lines += [
        "",
        "`vs padded` > 1 is faster. Packing and remat change the work, not the result: the "
        "losses agree up to float rounding (tests/tpu_jobs/test_packing.py and "
        "test_trainer.py::test_packed_steps_equal_unpacked_steps check values and gradients).",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
