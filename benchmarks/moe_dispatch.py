"""The experts' dispatch on this machine: jax.lax.ragged_dot against the tiled layout.

    python benchmarks/moe_dispatch.py [--repeats 20] [--out benchmarks/results/moe_dispatch.md]

One MoE layer's experts (`tpu_jobs.model.moe.DISPATCH`: "ragged_dot" and "tiled"), forward
and forward + backward (gradients of the input and the kernels), jitted, timed after a
warm-up call as the median of `--repeats` calls, in the same run for both, at the shapes
of a `demo_moe` training batch (32 rows x 64 tokens, top-2 of 8 experts) and of
Qwen3-30B-A3B's routing (top-8 of 128 experts) on 1,024 tokens with narrow experts (256
over hidden 512: its real 768 over 2048 needs ~10 GB here, more than this shared 24 GB
machine could spare beside the other jobs). The
ratio tiled / ragged_dot is what `model.moe_dispatch=auto` rests on (tiled on CPU).
Routing is a softmax top-k of random logits, so the load is uneven as in training.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from demo_seeds import cpu_name  # noqa: E402

from tpu_jobs.model import moe  # noqa: E402

# name -> (tokens, hidden, expert intermediate, experts, top-k)
SHAPES = {
    "demo_moe batch": (32 * 64, 128, 192, 8, 2),
    "30B-A3B's routing (top-8 of 128), narrow experts": (1024, 512, 256, 128, 8),
}


def timed(fn, args, repeats: int) -> float:
    """Median seconds of `fn(*args)` over `repeats` calls after one warm-up."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(shape: tuple[int, int, int, int, int], repeats: int) -> dict[str, dict[str, float]]:
    n, h, inter, e, k = shape
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (n, h))
    w_gate = 0.02 * jax.random.normal(keys[1], (e, h, inter))
    w_up = 0.02 * jax.random.normal(keys[2], (e, h, inter))
    w_down = 0.02 * jax.random.normal(keys[3], (e, inter, h))
    weights, experts = moe.route(jax.random.normal(keys[4], (n, e)), k, True)
    args = (x, experts, weights, w_gate, w_up, w_down)
    out = {}
    for name, fn in moe.DISPATCH.items():
        grad = jax.grad(lambda x, ex, w, g, u, d, fn=fn: jnp.sum(fn(x, ex, w, g, u, d) ** 2),
                        argnums=(0, 3, 4, 5))  # fmt: skip
        out[name] = {
            "forward": timed(jax.jit(fn), args, repeats),
            "forward + backward": timed(jax.jit(grad), args, repeats),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/moe_dispatch.md"))
    args = parser.parse_args()
    lines = [
        "# MoE dispatch: ragged_dot against the tiled layout",
        "",
        f"`python benchmarks/moe_dispatch.py --repeats {args.repeats}` on "
        f"{time.strftime('%Y-%m-%d')} ({cpu_name()}, {os.cpu_count()} cores, JAX "
        f"{jax.__version__}, {jax.default_backend()}); median ms per call, both in the same run.",
        "",
        "| shape | pass | ragged_dot ms | tiled ms | ragged_dot / tiled |",
        "|---|---|---:|---:|---:|",
    ]
    for name, shape in SHAPES.items():
        m = measure(shape, args.repeats)
        for part in ("forward", "forward + backward"):
            r, t = m["ragged_dot"][part], m["tiled"][part]
            lines.append(f"| {name} | {part} | {1e3 * r:.1f} | {1e3 * t:.1f} | {r / t:.1f}x |")
            print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
