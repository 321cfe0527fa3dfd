"""In-flight batches at the `100m` preset: a rollout worker's engine making K long-tail
batches one at a time against `rollout.inflight_batches` = 2 and 3 (one `Engine.stream`).

    nice -n 5 .venv/bin/python benchmarks/inflight.py [--preset 100m] [--batches 4]

Each batch is the engine benchmark's long-tail workload (benchmarks/engine.py: 64 prompts
of 16 tokens, up to 512 new tokens, EOS on, an untrained model: lengths are long-tailed),
with its own prompts and keys. One at a time, the worker calls `Engine.run` per batch:
the slots empty as the batch's rows finish and wait for its longest row. In flight, the
next batch is fed as soon as the current one is admitted and a slot is free (the feed
rule of `tpu_jobs.generate.inflight`), while fewer than `inflight_batches` batches have
rows in the engine. What is measured is the engine's part of a worker (useful tokens
per second, the live share of decode row-steps, each batch's latency from its feed to
its last row); scoring and commits run beside it on a thread in the worker and are not
timed here (benchmarks/loop.py times whole workers). Every mode compiles its programs in
an untimed pass first; modes alternate within each repeat. The tokens are compared
across modes: rows that share programs with other batches' rows may round their
log-probs differently in the last bits (benchmarks/results/row_invariance.md), which can
flip a sampled token only at a near-tie.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import EOS, device_line  # noqa: E402  (the long tail's EOS and header)

from pipeline.config import ModelConfig  # noqa: E402
from tpu_jobs.generate.engine import Completion, Engine, Request  # noqa: E402
from tpu_jobs.generate.interface import SamplingParams  # noqa: E402
from tpu_jobs.model.transformer import init_model  # noqa: E402

OUT = Path(__file__).parent / "results" / "inflight.md"


def batches(vocab: int, count: int, rows: int, new: int) -> list[list[Request]]:
    """`count` long-tail batches: prompts of 16 tokens, one key per row."""
    rng = np.random.default_rng(0)
    out = []
    for b in range(count):
        keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(b), rows)))
        out.append(
            [Request([1, *rng.integers(4, vocab, 15).tolist()], keys[r], new) for r in range(rows)]
        )
    return out


def one_at_a_time(engine: Engine, model, work: list[list[Request]], params) -> dict:
    done, latency, live, steps = [], [], 0, 0
    for reqs in work:
        t = time.perf_counter()
        done.append(engine.run(model, reqs, params))
        latency.append(time.perf_counter() - t)
        live += engine.stats["live_row_steps"]
        steps += engine.stats["decode_row_steps"]
    return dict(done=done, latency=latency, live=live, steps=steps)


def in_flight(engine: Engine, model, work: list[list[Request]], params, k: int) -> dict:
    """One stream, fed as `tpu_jobs.generate.inflight` feeds it."""
    size = len(work[0])
    todo = list(range(len(work)))
    left: dict[int, int] = {}  # batch -> rows not done
    fed_at: dict[int, float] = {}
    latency = [0.0] * len(work)
    done: list[list[Completion | None]] = [[None] * size for _ in work]

    def feed() -> list[Request]:
        if not todo or len(left) >= k:
            return []
        b = todo.pop(0)
        left[b], fed_at[b] = size, time.perf_counter()
        return work[b]

    def on_done(row: int, c: Completion) -> None:
        b, r = divmod(row, size)
        done[b][r] = c
        left[b] -= 1
        if left[b] == 0:
            del left[b]
            latency[b] = time.perf_counter() - fed_at[b]

    engine.stream(model, params, feed, on_done)
    return dict(
        done=done,
        latency=latency,
        live=engine.stats["live_row_steps"],
        steps=engine.stats["decode_row_steps"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--inflight", default="2,3")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    cfg = ModelConfig(preset=args.preset, max_seq_len=1024)
    model = init_model(cfg, seed=0)
    work = batches(cfg.vocab_size, args.batches, args.rows, args.new)
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0, dtype=args.dtype)
    engine = Engine(cfg, eos_id=EOS, max_slots=64, page_size=16, chunk=8)
    modes = {"one at a time": lambda: one_at_a_time(engine, model, work, params)}
    for k in map(int, args.inflight.split(",")):
        modes[f"in flight, {k} batches"] = lambda k=k: in_flight(engine, model, work, params, k)
    load = os.getloadavg()[0]
    for name, fn in modes.items():  # compile every bucket each mode meets
        print(f"[warm] {name}", flush=True)
        fn()
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for rep in range(args.repeats):
        for name, fn in modes.items():
            t = time.perf_counter()
            out = fn()
            out["wall"] = time.perf_counter() - t
            runs[name].append(out)
            useful = sum(len(c.tokens) for b in out["done"] for c in b)
            print(f"[{rep}] {name}: {useful / out['wall']:.0f} useful tok/s", flush=True)
    ref = runs["one at a time"][0]["done"]
    useful = sum(len(c.tokens) for b in ref for c in b)
    lengths = [len(c.tokens) for b in ref for c in b]
    base = statistics.median(useful / r["wall"] for r in runs["one at a time"])
    lines = [
        "# In-flight batches: a worker's engine on the long tail",
        "",
        (__doc__ or "").split("\n\n", 2)[2].strip(),  # the method, after title and command
        "",
        f"{device_line()}; load average before the run {load:.1f}. `{args.preset}` preset "
        f"({args.dtype}), {args.batches} batches of {args.rows} rows, up to {args.new} new "
        f"tokens; {useful:,} useful tokens in all (row lengths: median "
        f"{statistics.median(lengths):.0f}, max {max(lengths)}). Command: `nice -n 5 "
        f".venv/bin/python benchmarks/inflight.py --preset {args.preset} --dtype {args.dtype} "
        f"--batches {args.batches} --inflight {args.inflight} --repeats {args.repeats}`.",
        "",
        "| mode | useful tok/s (each repeat) | vs one at a time (median) | live row-steps "
        "| batch latency s (median, max) | rows whose tokens differ from one at a time |",
        "|---|---|---:|---:|---|---:|",
    ]
    for name, reps in runs.items():
        rates = [sum(len(c.tokens) for b in r["done"] for c in b) / r["wall"] for r in reps]
        lat = [x for r in reps for x in r["latency"]]
        differ = sum(
            c.tokens != w.tokens
            for r in reps
            for got, want in zip(r["done"], ref, strict=True)
            for c, w in zip(got, want, strict=True)
        )
        lines.append(
            f"| {name} | {', '.join(f'{x:.0f}' for x in rates)} | "
            f"{statistics.median(rates) / base:.2f}x | {reps[0]['live'] / reps[0]['steps']:.0%} | "
            f"{statistics.median(lat):.1f}, {max(lat):.1f} | {differ} of "
            f"{len(reps) * len(lengths)} |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
