"""Parameter-server throughput: push and pull of a snapshot against `cp` of the same bytes.

* Local backend: a `--size-mib` snapshot (default 1 GiB, float32 tensors of a few sizes, as
  in a model) is published with `ParamServer.publish` (push) and read back and verified
  with `ParamServer.pull` (pull), in a directory on the same disk where `cp` copies a file
  holding the same bytes. Each repeat runs cp and push (alternating which goes first, so
  load from other users of the machine hits both alike) then pull, and `sync`s outside the
  timings; the table gives medians.
* GCS emulator (fake-gcs-server, in-memory, on 127.0.0.1): push and pull of a
  `--gcs-size-mib` snapshot through `GCSStore` (HTTP, crc32c on both ends).
* Pull latency of the `demo` model preset (tpu_jobs.model.transformer init_model + flat_params): what a
  rollout worker pays for a new policy version (LATEST read + manifest + shards + verify).

    .venv/bin/python benchmarks/paramserver.py [--size-mib 1024] [--gcs-size-mib 128]
        [--repeats 9] [--dir DIR] [--no-gcs]

Writes the table to benchmarks/results/paramserver.md.

With `--deltas` it measures delta versions instead (`benchmarks/paramserver_deltas.py`,
results in benchmarks/results/paramserver_deltas.md): a real RL run publishing bfloat16
versions, then push/pull of full and delta versions of its weights on both backends. Warm page cache: nothing here drops
caches (the machine is shared), so "disk" means the kernel's page cache plus whatever
write-back the kernel does meanwhile, for cp as for the parameter server.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.emulated_gcs import gcs_client, start_emulator  # noqa: E402
from pipeline.paramserver import ParamServer  # noqa: E402
from pipeline.storage import GCSStore, LocalStore  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "paramserver.md"
MIB = 1 << 20


def make_tensors(size_mib: int, seed: int = 0, layers: int = 16) -> dict[str, np.ndarray]:
    """float32 tensors adding up to `size_mib`, shaped like a decoder's: an embedding (1/8),
    per layer qkv/out/mlp_in/mlp_out in the ratio 3:1:4:4 and a small norm."""
    rng = np.random.default_rng(seed)
    total = size_mib * MIB // 4  # float32 elements
    sizes = {"embed": total // 8}
    norm = 1024
    unit = (total - sizes["embed"] - layers * norm) // (12 * layers)
    for i in range(layers):
        for name, k in (("attn_qkv", 3), ("attn_out", 1), ("mlp_in", 4), ("mlp_out", 4)):
            sizes[f"layer{i:02d}/{name}"] = k * unit
        sizes[f"layer{i:02d}/norm"] = norm
    sizes["final_norm"] = total - sum(sizes.values())
    tensors = {name: rng.random(n, dtype=np.float32) for name, n in sizes.items()}
    assert sum(t.nbytes for t in tensors.values()) == size_mib * MIB
    return tensors


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def sync() -> None:
    os.sync()


def bench_local(
    tensors: dict[str, np.ndarray], workdir: Path, repeats: int, shard_mib: int, workers: int
) -> dict:
    nbytes = sum(t.nbytes for t in tensors.values())
    src = workdir / "src.bin"
    with open(src, "wb") as f:
        for name in sorted(tensors):
            f.write(memoryview(tensors[name]).cast("B"))
    sync()
    cp_s, push_s, pull_s = [], [], []
    for r in range(repeats):
        dst = workdir / f"dst-{r}.bin"
        store_dir = workdir / f"store-{r}"
        ps = ParamServer(LocalStore(store_dir), shard_bytes=shard_mib * MIB, max_workers=workers)
        epoch = ps.acquire_epoch()

        def cp(dst: Path = dst) -> None:
            t, _ = timed(lambda: subprocess.run(["cp", "--reflink=never", src, dst], check=True))
            cp_s.append(t)
            dst.unlink()
            sync()

        def push(ps: ParamServer = ps, epoch: int = epoch) -> None:
            t, _ = timed(lambda: ps.publish(0, tensors, epoch=epoch))
            push_s.append(t)
            sync()

        # Alternate which goes first, so drifting load from other users favours neither.
        for step in (cp, push) if r % 2 == 0 else (push, cp):
            step()

        t, snap = timed(lambda ps=ps: ps.pull(0))
        pull_s.append(t)
        if r == 0:  # correctness, outside the timing
            for name, arr in tensors.items():
                assert snap.tensors[name].tobytes() == arr.tobytes(), name
        del snap
        gc.collect()
        shutil.rmtree(store_dir)
        sync()
        print(
            f"  local repeat {r + 1}/{repeats}: cp {cp_s[-1]:.2f}s push {push_s[-1]:.2f}s "
            f"pull {pull_s[-1]:.2f}s",
            flush=True,
        )
    src.unlink()
    return {"bytes": nbytes, "cp": cp_s, "push": push_s, "pull": pull_s}


def bench_gcs(
    tensors: dict[str, np.ndarray],
    client,
    bucket: str,
    repeats: int,
    shard_mib: int,
    workers: int,
) -> dict:
    nbytes = sum(t.nbytes for t in tensors.values())
    push_s, pull_s = [], []
    for r in range(repeats):
        store = GCSStore(bucket, f"bench-{os.getpid()}-{r}", client=client)
        ps = ParamServer(store, shard_bytes=shard_mib * MIB, max_workers=workers)
        epoch = ps.acquire_epoch()
        t, _ = timed(lambda ps=ps, epoch=epoch: ps.publish(0, tensors, epoch=epoch))
        push_s.append(t)
        t, snap = timed(lambda ps=ps: ps.pull(0))
        pull_s.append(t)
        if r == 0:
            for name, arr in tensors.items():
                assert snap.tensors[name].tobytes() == arr.tobytes(), name
        del snap
        for key in store.list():
            store.delete(key)
        gc.collect()
        print(
            f"  gcs repeat {r + 1}/{repeats}: push {push_s[-1]:.2f}s pull {pull_s[-1]:.2f}s",
            flush=True,
        )
    return {"bytes": nbytes, "push": push_s, "pull": pull_s}


def bench_demo_pull(stores: dict[str, object], repeats: int) -> dict[str, dict]:
    """Worker-side latency for the demo preset: latest_version() + pull(), median/p90."""
    from pipeline.config import ModelConfig
    from tpu_jobs.model.transformer import flat_params, init_model

    flat = {
        k: np.asarray(v) for k, v in flat_params(init_model(ModelConfig(preset="demo"), 0)).items()
    }
    out = {}
    for label, store in stores.items():
        ps = ParamServer(store)
        epoch = ps.acquire_epoch()
        ps.publish(0, flat, epoch=epoch)
        ps.pull(0)  # warm connections and caches
        times = []
        for _ in range(repeats):
            t, _ = timed(lambda ps=ps: ps.pull(ps.latest_version()))
            times.append(t)
        times.sort()
        out[label] = {
            "params": sum(a.size for a in flat.values()),
            "bytes": sum(a.nbytes for a in flat.values()),
            "tensors": len(flat),
            "median_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
        }
    return out


# --------------------------------------------------------------------------- report


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / MIB / seconds


def write_report(args, local: dict, gcs: dict | None, demo: dict, path: Path) -> str:
    nb = local["bytes"]
    cp = statistics.median(local["cp"])
    rows = [
        "| operation | bytes | median (s) | min / max (s) | MiB/s | vs cp |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, key in (("cp (same bytes, same disk)", "cp"), ("push (publish)", "push"),
                       ("pull (pull + verify)", "pull")):  # fmt: skip
        ts = local[key]
        med = statistics.median(ts)
        rows.append(
            f"| local {label} | {nb / MIB:.0f} MiB | {med:.2f} | {min(ts):.2f} / {max(ts):.2f} "
            f"| {_mbps(nb, med):,.0f} | {cp / med:.2f}x |"
        )
    if gcs is not None:
        gb = gcs["bytes"]
        for label, key in (("push (publish)", "push"), ("pull (pull + verify)", "pull")):
            ts = gcs[key]
            med = statistics.median(ts)
            rows.append(
                f"| emulator {label} | {gb / MIB:.0f} MiB | {med:.2f} | {min(ts):.2f} / "
                f"{max(ts):.2f} | {_mbps(gb, med):,.0f} | |"
            )
    demo_rows = [
        "| backend | params | bytes | tensors | median (ms) | p90 (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, d in demo.items():
        demo_rows.append(
            f"| {label} | {d['params']:,} | {d['bytes'] / MIB:.2f} MiB | {d['tensors']} | "
            f"{d['median_ms']:.1f} | {d['p90_ms']:.1f} |"
        )
    cpus = len(os.sched_getaffinity(0))
    raw = [
        f"- local {k}: " + ", ".join(f"{t:.2f}" for t in local[k]) for k in ("cp", "push", "pull")
    ]
    if gcs is not None:
        raw += [
            f"- emulator {k}: " + ", ".join(f"{t:.2f}" for t in gcs[k]) for k in ("push", "pull")
        ]
    load = ", ".join(f"{x:.1f}" for x in args.loadavg)
    text = f"""# Parameter server throughput

Command: `.venv/bin/python benchmarks/paramserver.py --size-mib {args.size_mib}
--gcs-size-mib {args.gcs_size_mib} --repeats {args.repeats}`

- push: `ParamServer.publish` (shard plan, crc32c, create-only shard writes, manifest,
  CAS of LATEST); pull: `ParamServer.pull` (manifest, shards, crc32c verification,
  read-only tensor views) of a float32 snapshot shaped like a decoder's weights.
- baseline: `cp --reflink=never` of a file holding the same bytes, in the same directory.
- each repeat runs cp and push (alternating which goes first) then pull, with `sync`
  outside the timings; medians over {args.repeats} repeats; shards of {args.shard_mib} MiB,
  up to {args.workers} threads (on a local store at most two per CPU).
- machine: {platform.machine()}, {cpus} CPUs and one disk shared with other users (load
  average {load} at the start), Python {platform.python_version()}; warm page cache (caches
  are not dropped on a shared machine).

{chr(10).join(rows)}

"vs cp" is cp's median time divided by the operation's (the target is >= 0.7x). The
emulator is fake-gcs-server with its in-memory backend on 127.0.0.1: its rows measure the
HTTP client path (JSON API, multipart uploads, crc32c on both ends), not GCS.

## Pull latency of the `demo` preset

What a rollout worker pays to switch to a new policy version: `latest_version()` then
`pull(v)` (manifest, shards, crc32c), median and p90 of {args.demo_repeats} pulls after a
warm-up pull.

{chr(10).join(demo_rows)}

## All timings (s)

{chr(10).join(raw)}
"""
    path.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--gcs-size-mib", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--gcs-repeats", type=int, default=5)
    parser.add_argument("--demo-repeats", type=int, default=30)
    parser.add_argument("--shard-mib", type=int, default=64)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--no-gcs", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--deltas",
        action="store_true",
        help="the delta-version benchmark (benchmarks/paramserver_deltas.py: its own options)",
    )
    argv = sys.argv[1:] if argv is None else argv
    if "--deltas" in argv:
        from benchmarks.paramserver_deltas import main as deltas_main

        return deltas_main([a for a in argv if a != "--deltas"])
    args = parser.parse_args(argv)
    args.loadavg = os.getloadavg()

    workdir = Path(tempfile.mkdtemp(prefix="ps-bench-", dir=args.dir))
    emulator = None
    try:
        print(f"local: {args.size_mib} MiB in {workdir}", flush=True)
        tensors = make_tensors(args.size_mib)
        local = bench_local(tensors, workdir, args.repeats, args.shard_mib, args.workers)
        del tensors
        gc.collect()
        demo_stores: dict[str, object] = {"local": LocalStore(workdir / "demo")}
        gcs = None
        if not args.no_gcs:
            emulator, url = start_emulator(workdir)
            client = gcs_client(url)
            bucket = "rlax-bench"
            client.create_bucket(bucket)
            print(f"emulator: {args.gcs_size_mib} MiB at {url}", flush=True)
            gcs = bench_gcs(
                make_tensors(args.gcs_size_mib, seed=1),
                client,
                bucket,
                args.gcs_repeats,
                args.shard_mib,
                args.workers,
            )
            demo_stores["fake-gcs-server"] = GCSStore(bucket, "demo", client=client)
        demo = bench_demo_pull(demo_stores, args.demo_repeats)
        print(write_report(args, local, gcs, demo, Path(args.out)))
    finally:
        if emulator is not None:
            emulator.terminate()
            emulator.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
