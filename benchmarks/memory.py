"""Memory of the project's real programs at real model shapes, from XLA's own analysis.

Compiles (never runs) the trainer's whole step (`tpu_jobs.learning.memory.train_step_memory`: the
fused GRPO step, forward + loss + backward + AdamW) and the sampler's generate program
(`sampler_memory`) for Qwen2.5 shapes, with abstract inputs, and tabulates
`compiled.memory_analysis()`: temporaries and arguments, in GiB per device. Each setting
is a row, so each item's effect on the same shape is visible:

* `dense head` (model.logits_chunk=0): the LM head over every token at once, the
  [B, T, V] logits stored for the backward pass: the project before chunking.
* `chunked head` (logits_chunk=512): log-probs from the head in chunks, recomputed.
* `+ remat full` / `+ remat dots` (model.remat): a scan over the layers, each under
  `jax.checkpoint` (tpu_jobs/model/transformer.py says why a scan).
* `+ bf16` (model.dtype=bfloat16): bfloat16 compute, float32 master weights.
* `+ chunked attention` (model.attention=chunked): attention over blocks of 512 queries,
  each recomputed in the backward pass, so one block's probabilities exist at once. On
  GPU, model.attention=cudnn (flash attention) does the same job faster; it cannot be
  compiled on a CPU.

`--lora 64` compiles each train-step row as a LoRA run instead (lora.rank=64,
lora.base_dtype=bfloat16; row "<setting> + LoRA r64, bf16 base"): the trained state is the
adapters and their AdamW moments, the frozen bfloat16 base an argument beside them (and the
KL reference); `--lora 0,64` gives both rows (0 = full RL).

`--fsdp N` compiles the train-step rows on a mesh of N fake CPU devices with
mesh.trainer = [1, N, 1] (FSDP; the activation constraints of tpu_jobs/model/constraints.py):
the figures are per device. `--expert M` (mixture-of-experts shapes such as `30b-a3b`,
Qwen3-30B-A3B) and `--tensor T` add those axes: N x T x M devices, mesh.trainer =
[1, N, T, M], each expert kernel split over all three (experts over `expert`, hidden over
`fsdp`, intermediate over `tensor`); the 8 rows must split over N x M. Sampler rows: `float32` / `bfloat16`, and `kv budget` rows
under sampler.kv_token_budget (`--kv-budget`, token slots per generate program).

Rows are 8 sequences of `prompt + completion` tokens (GRPO, one group of 8).

    .venv/bin/python benchmarks/memory.py [--models 0.5b] [--tokens 2048,8192] [--fsdp 8]
        [--lora 0,64]

Compiles take minutes per row on 2 cores (24 layers at 8k tokens); `--models 7b` at 16k
needs a machine with more memory for the compiler. Writes benchmarks/results/memory.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import load_config  # noqa: E402

PROMPT = 256
SETTINGS: dict[str, list[str]] = {
    "dense head": ["model.logits_chunk=0"],
    "chunked head": [],
    "+ remat full": ["model.remat=full"],
    "+ remat dots": ["model.remat=dots"],
    "+ remat full + bf16": ["model.remat=full", "model.dtype=bfloat16"],
    "+ remat full + chunked attention": ["model.remat=full", "model.attention=chunked"],
    "+ remat full + chunked attention + bf16": [
        "model.remat=full",
        "model.attention=chunked",
        "model.dtype=bfloat16",
    ],
}
GIB = 2**30


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="0.5b", help="of 0.5b, 1.5b, 7b, 32b, 30b-a3b")
    parser.add_argument("--tokens", default="2048,8192", help="tokens per sequence")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="rows, by name")
    parser.add_argument("--sampler", default="64x256+1024,64x256+4096", help="'' for none")
    parser.add_argument("--fsdp", type=int, default=0, help="train step on N fake devices")
    parser.add_argument("--tensor", type=int, default=1, help="and a tensor axis of T")
    parser.add_argument("--expert", type=int, default=1, help="and an expert axis of M")
    parser.add_argument(
        "--lora", default="0", help="train-step rows at these LoRA ranks (0 = full RL)"
    )
    parser.add_argument(
        "--kv-budget", type=int, default=131072, help="sampler.kv_token_budget of its rows"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/memory.md"))
    parser.add_argument(
        "--append", action="store_true", help="add the rows to --out's table (same machine)"
    )
    args = parser.parse_args(argv)
    devices = args.fsdp * args.tensor * args.expert
    if args.fsdp:  # before jax is imported: XLA reads the flag at start-up
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    from tpu_jobs.learning.memory import sampler_memory, shape_overrides, train_step_memory
    from tpu_jobs.model import mesh as meshlib

    def config(shape: str, tokens: int, extra: list[str]):
        return load_config(
            None,
            [
                *shape_overrides(shape),
                f"model.max_seq_len={tokens}",
                f"sampler.max_new_tokens={tokens - PROMPT}",
                "rollout.prompts_per_batch=1",
                "rollout.group_size=8",
                *extra,
            ],
        )

    shape = (1, args.fsdp, args.tensor, args.expert)
    mesh = meshlib.make_mesh(shape) if args.fsdp else None
    on = f" on {devices} devices (FSDP)" if args.fsdp else ""
    if args.fsdp and devices > args.fsdp:
        axes = ", ".join(
            f"{a} {n}" for a, n in zip(meshlib.AXES[1:], shape[1:], strict=True) if n > 1
        )
        on = f" on {devices} devices ({axes})"
    samplers = {
        "float32": ("float32", []),
        "bfloat16": ("bfloat16", []),
        "float32, kv budget": ("float32", [f"sampler.kv_token_budget={args.kv_budget}"]),
        "bfloat16, kv budget": ("bfloat16", [f"sampler.kv_token_budget={args.kv_budget}"]),
    }
    rows = []
    for shape in args.models.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            for name in filter(None, args.settings.split(",")):
                for rank in (int(r) for r in args.lora.split(",")):
                    extra, row = SETTINGS[name], name
                    if rank:
                        extra = [*extra, f"lora.rank={rank}", "lora.base_dtype=bfloat16"]
                        row = f"{name} + LoRA r{rank}, bf16 base"
                    t0 = time.perf_counter()
                    m = train_step_memory(config(shape, tokens, extra), PROMPT, mesh)
                    rows.append(("train step", shape, f"8 x {tokens}", row + on, m,
                                 time.perf_counter() - t0))  # fmt: skip
                    print(rows[-1], flush=True)
        for spec in filter(None, args.sampler.split(",")):
            batch, rest = spec.split("x")
            prompt, new = (int(x) for x in rest.split("+"))
            for name, (dtype, extra) in samplers.items():
                t0 = time.perf_counter()
                cfg = config(shape, prompt + new, extra)
                m = sampler_memory(cfg, int(batch), prompt, new, dtype=dtype)
                rows.append(("sampler", shape, f"{batch} x ({prompt} + {new})", name, m,
                             time.perf_counter() - t0))  # fmt: skip
                print(rows[-1], flush=True)
    lines = [
        "# Memory of the train step and the sampler (XLA's memory_analysis)",
        "",
        f"`python benchmarks/memory.py --models {args.models} --tokens {args.tokens}` on "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {devices or 'one'} CPU device(s); compiled, never run. "
        "GiB per device: temporaries (the program's own buffers, after XLA's buffer "
        "assignment) and arguments (weights, optimizer state, batch).",
        "",
        "| program | model | tokens | setting | temporaries | arguments | total | compile s |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for prog, shape, toks, name, m, secs in rows:
        temp, arg = m["temp_bytes"] / GIB, m["argument_bytes"] / GIB
        lines.append(
            f"| {prog} | {shape} | {toks} | {name} | {temp:.2f} | {arg:.2f} | "
            f"{temp + arg:.2f} | {secs:.0f} |"
        )
    out = Path(args.out)
    if args.append and out.exists():  # keep the file, add this run's rows to its table
        old = out.read_text().rstrip("\n").split("\n")
        end = max(i for i, line in enumerate(old) if line.startswith(("| train", "| sampler")))
        lines = old[: end + 1] + lines[6:] + old[end + 1 :]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
