"""Delta versions of the parameter server, measured on a real RL run.

1. A real RL run (trainer + one rollout worker as processes, `pipeline.ops.launcher`) of the
   `--preset` model (default `100m`) for `--steps` steps at the demo's learning rate and
   schedule (configs/demo.yaml), publishing every step in bfloat16 (`paramserver.dtype`)
   as deltas with a full snapshot every `--full-every` versions. The base is the preset's
   random initialisation (an SFT of a 100M model does not fit a CPU benchmark): it earns
   no reward on arithmetic, so GRPO's advantages are zero, and the run adds an entropy
   bonus (`--entropy-coef`) so that every step moves the weights; AdamW's per-element step
   is about lr whatever the gradient's scale, so the changed fraction is what RL with
   rewards gets at this learning rate (see the results file for what that assumes).
2. From the run's versions (pulled and rebuilt from its store): the fraction of bfloat16
   elements that changed per step, and the bytes of full and delta versions (the delta's
   encoding next to a sparse index + value encoding's size, 4 + 2 bytes per changed element).
3. On the local backend and on the GCS emulator (fake-gcs-server on 127.0.0.1): push time of
   a full and of a delta version (`ParamServer.publish`), the pull of the newest version by a
   worker holding the previous one against a full pull, and a late joiner's pull of the
   version `full_every - 1` deltas after a full snapshot.

    .venv/bin/python benchmarks/paramserver.py --deltas [--preset 100m] [--steps 20]
        [--full-every 10] [--root DIR] [--no-gcs]

Writes benchmarks/results/paramserver_deltas.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline import weight_codec  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.ops import launcher  # noqa: E402
from pipeline.paramserver import ParamServer, Snapshot  # noqa: E402
from pipeline.problem_sets import write_data  # noqa: E402
from pipeline.run import Run, base_server, weights_server  # noqa: E402
from pipeline.storage import GCSStore, LocalStore  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "paramserver_deltas.md"
MIB = 1 << 20


def rl_run(args, root: Path) -> Run:
    """The RL run: data, the preset's initial weights as the base, trainer + 1 worker."""
    cfg = load_config(
        ROOT / "configs/demo.yaml",
        [
            f"model.preset={args.preset}",
            "workers=1",
            f"trainer.steps={args.steps}",
            "trainer.checkpoint_every=1000",
            # On-policy: the trainer's recomputed log-probs then differ from the worker's only
            # by the published dtype (a stale batch adds a step's policy change).
            "trainer.max_staleness=0",
            f"trainer.entropy_coef={args.entropy_coef}",
            f"rollout.prompts_per_batch={args.prompts}",
            f"rollout.group_size={args.group}",
            f"sampler.max_new_tokens={args.max_new_tokens}",
            "paramserver.dtype=bfloat16",
            f"paramserver.full_every={args.full_every}",
            "task.num_train=2000",
            "task.num_eval=10",
        ],
    )
    run = Run.create(str(root / "run"), cfg)
    write_data(run)
    from tpu_jobs.model.transformer import flat_params, init_model

    base = base_server(run)
    flat = {k: np.asarray(v) for k, v in flat_params(init_model(cfg.model, cfg.seed)).items()}
    base.publish(0, flat, epoch=base.acquire_epoch(), metadata={"init": "random"})
    fleet = launcher.Fleet(run.url, log_dir=root / "logs")
    t0 = time.time()
    fleet.start("trainer", "train")
    fleet.start("w0", "rollout", ("--worker-id", "w0"))
    try:
        fleet.wait("trainer", poll_s=2.0)
        fleet.wait("w0", poll_s=2.0)
    finally:
        fleet.stop()
    print(f"RL run: {args.steps} steps in {time.time() - t0:.0f}s", flush=True)
    return run


def version_stats(run: Run, steps: int) -> tuple[list[dict], dict]:
    """Per version: changed fraction vs the previous one, stored bytes; and the sizes."""
    ps = weights_server(run)
    rows, prev = [], None
    for v in range(steps + 1):
        snap = ps.pull(v, have=prev)
        m = ps.manifest(v)
        row = {
            "version": v,
            "full_bytes": sum(s["size"] for s in m.get("full", {}).get("shards", [])) or None,
            "delta_bytes": sum(s["size"] for s in m.get("delta", {}).get("shards", [])) or None,
        }
        if prev is not None:
            changed = total = 0
            for name, arr in snap.tensors.items():
                old = prev.tensors[name]
                changed += int(np.count_nonzero(arr.view(np.uint16) != old.view(np.uint16)))
                total += arr.size
            row["changed"] = changed
            row["changed_frac"] = changed / total
            row["sparse_bytes"] = changed * (4 + arr.dtype.itemsize)  # index + value
            # One thread's CPU for the codec alone (bytes in memory, no storage): the floor of
            # a push's delta encoding and of a pull's rebuild (decode + XOR + crc32c).
            t0 = time.thread_time()
            blobs = {pid: weight_codec.encode_delta(a, prev.pieces[pid])
                     for pid, a in snap.pieces.items()}  # fmt: skip
            t1 = time.thread_time()
            for pid, blob in blobs.items():
                weight_codec.apply_delta(blob, prev.pieces[pid])
            row["encode_cpu_s"], row["decode_cpu_s"] = t1 - t0, time.thread_time() - t1
        rows.append(row)
        prev = snap
    raw = sum(a.nbytes for a in prev.tensors.values())
    return rows, {"params": sum(a.size for a in prev.tensors.values()), "raw_bytes": raw}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def timed_cpu(fn):
    """(wall s, this process's CPU s over all its threads, result)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def bench_backend(label: str, make_store, run: Run, steps: int, full_every: int) -> dict:
    """Republish the run's versions into fresh stores of one backend: v0 full, then each
    version once as a delta alone and once as a full snapshot alone; a worker holding v-1
    pulls v both ways; then a late joiner."""
    load_before = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    src = weights_server(run)
    deltas = ParamServer(make_store("deltas"), max_workers=8)
    fulls = ParamServer(make_store("fulls"), max_workers=8)
    e1, e2 = deltas.acquire_epoch(), fulls.acquire_epoch()
    out = {k: [] for k in ("push_full", "push_delta", "pull_full", "pull_delta",
                           "pull_full_cpu", "pull_delta_cpu")}  # fmt: skip
    prev = src.pull(0)
    base = Snapshot.of(0, prev.tensors)
    deltas.publish_snapshot(base, epoch=e1, full_every=full_every)
    held = deltas.pull(0)
    for v in range(1, steps + 1):
        cur = src.pull(v, have=prev)

        def push_delta(v=v, cur=cur, base=base) -> Snapshot:
            # As the trainer does: cut once, publish, keep it as the next delta's base.
            snap = Snapshot.of(v, cur.tensors)
            deltas.publish_snapshot(snap, epoch=e1, base=base, full=False, full_every=full_every)
            return snap

        t, base = timed(push_delta)
        out["push_delta"].append(t)
        t, _ = timed(lambda v=v, cur=cur: fulls.publish(v, cur.tensors, epoch=e2))
        out["push_full"].append(t)
        t, cpu, snap = timed_cpu(lambda v=v, held=held: deltas.pull(v, have=held))
        assert snap.deltas == (v,) and snap.full_from is None
        out["pull_delta"].append(t)
        out["pull_delta_cpu"].append(cpu)
        t, cpu, full = timed_cpu(lambda v=v: fulls.pull(v))
        out["pull_full"].append(t)
        out["pull_full_cpu"].append(cpu)
        if v == 1:  # correctness, outside the timings
            for name, arr in cur.tensors.items():
                assert snap.tensors[name].tobytes() == arr.tobytes() == full.tensors[name].tobytes()
        del full
        fulls.gc(keep_last=1)  # the emulator keeps objects in memory
        held, prev = snap, cur
        print(
            f"  {label} v{v}: push full {out['push_full'][-1]:.2f}s delta "
            f"{out['push_delta'][-1]:.2f}s, pull full {out['pull_full'][-1]:.2f}s delta "
            f"{out['pull_delta'][-1]:.2f}s",
            flush=True,
        )
    # A late joiner: a full snapshot at version full_every, then full_every - 1 deltas.
    joiner = ParamServer(make_store("joiner"), max_workers=8)
    e3 = joiner.acquire_epoch()
    last = min(steps, 2 * full_every - 1)
    prev = None
    for v in range(full_every, last + 1):
        snap = Snapshot.of(v, src.pull(v).tensors)
        joiner.publish_snapshot(snap, epoch=e3, base=prev, full=prev is None,
                                full_every=full_every)  # fmt: skip
        prev = snap
    reader = ParamServer(joiner.store, max_workers=8)
    out["late_joiner"] = []
    for _ in range(3):
        t, snap = timed(lambda: reader.pull(last))
        out["late_joiner"].append(t)
    out["late_joiner_chain"] = [snap.full_from, list(snap.deltas)]
    full_t = [timed(lambda: fulls.pull(steps))[0] for _ in range(3)]
    out["late_joiner_full_pull"] = full_t
    out["load"] = [load_before, ", ".join(f"{x:.1f}" for x in os.getloadavg())]
    return out


def write_report(args, rows, sizes, alignment, timings, meta, path: Path) -> str:
    med = statistics.median
    deltas = [r for r in rows[1:]]
    frac = [r["changed_frac"] for r in deltas]
    full_b = [r["full_bytes"] for r in rows if r["full_bytes"]]
    delta_b = [r["delta_bytes"] for r in deltas]
    sparse_b = [r["sparse_bytes"] for r in deltas]
    ratio = med(full_b) / med(delta_b)
    enc = [r["encode_cpu_s"] for r in deltas]
    dec = [r["decode_cpu_s"] for r in deltas]
    lines = [
        "| version | changed elements | fraction | delta bytes | sparse idx+val bytes | full bytes |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['version']} | {r.get('changed', '')} | "
            + (f"{r['changed_frac']:.4f}" if "changed_frac" in r else "")
            + f" | {r['delta_bytes'] or ''} | {r.get('sparse_bytes', '')} | {r['full_bytes'] or ''} |"
        )
    trows = [
        "| backend | push full (s) | push delta (s) | pull full (s) | pull newest from held (s) "
        "| pull speed-up | pull CPU full / delta (s) | late joiner: full + deltas (s) "
        "| full pull (s) | load average before / after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, t in timings.items():
        trows.append(
            f"| {label} | {med(t['push_full']):.3f} | {med(t['push_delta']):.3f} | "
            f"{med(t['pull_full']):.3f} | {med(t['pull_delta']):.3f} | "
            f"{med(t['pull_full']) / med(t['pull_delta']):.1f}x | "
            f"{med(t['pull_full_cpu']):.3f} / {med(t['pull_delta_cpu']):.3f} | "
            f"{med(t['late_joiner']):.3f} "
            f"(v{t['late_joiner_chain'][0]} + {len(t['late_joiner_chain'][1])}) | "
            f"{med(t['late_joiner_full_pull']):.3f} | {t['load'][0]} / {t['load'][1]} |"
        )
    align = "\n".join(
        f"| {k} | {med(v):.3g} | {min(v):.3g} / {max(v):.3g} |" for k, v in alignment.items()
    )
    raw = [
        f"- {label} {k}: " + ", ".join(f"{x:.3f}" for x in t[k])
        for label, t in timings.items()
        for k in (
            "push_full",
            "push_delta",
            "pull_full",
            "pull_delta",
            "pull_full_cpu",
            "pull_delta_cpu",
            "late_joiner",
        )  # fmt: skip
    ]
    text = f"""# Parameter server: delta versions on a real RL run

Command: `nice -n 5 .venv/bin/python benchmarks/paramserver.py --deltas --preset {args.preset}
--steps {args.steps} --full-every {args.full_every}`

{meta["note"]}

- Model: `{args.preset}` preset, {sizes["params"]:,} parameters; versions published in
  bfloat16: {sizes["raw_bytes"] / MIB:.1f} MiB of raw tensor bytes per version.
- RL run: GRPO, the demo's learning rate ({meta["lr"]}) and schedule (warm-up
  {meta["warmup"]} steps, cosine), {args.prompts} prompts x {args.group} samples a step,
  {args.max_new_tokens} new tokens, publish every step, on-policy (`max_staleness=0`),
  `paramserver.full_every={args.full_every}`; trainer and one rollout worker as processes
  on a local run; wall
  time {meta["rl_wall_s"]:.0f} s. Base: the preset's random initialisation, so every reward
  was 0 (mean reward {meta["reward_mean"]:.3f}) and GRPO's advantages vanish; the entropy
  bonus (`entropy_coef={args.entropy_coef}`) is what moved the weights. AdamW's step per
  element is ~lr x m/sqrt(v) whatever the gradient's scale, so the fraction that changes
  in bfloat16 depends on lr against the weights' magnitudes; a consistent gradient (this
  bonus) makes |m/sqrt(v)| near 1, noisy advantage-weighted gradients make it smaller, so
  this is on the high side of what a rewarded run at this lr changes.
- Machine: {platform.machine()}, {len(os.sched_getaffinity(0))} CPUs shared with other
  users (load average {meta["load"]} at the start), Python {platform.python_version()}.

## Bytes per version

Median over the run: a delta is **{ratio:.1f}x** smaller than a full bfloat16 snapshot
(target >= 5x). Median changed fraction per step: {med(frac):.4f} (min {min(frac):.4f},
max {max(frac):.4f}); the sparse index + value encoding would take a median of
{med(sparse_b) / MIB:.2f} MiB against the XOR + byte-plane + zstd delta's
{med(delta_b) / MIB:.2f} MiB.

{chr(10).join(lines)}

## Push and pull

Each version of the run republished into fresh stores: as a delta (push delta) and, in
another store, as a full snapshot (push full); a worker holding version v-1 pulls v from
the deltas (pull newest from held: one delta, rebuilt and crc32c-verified) against a full
pull of v. Medians over {args.steps} versions. Late joiner: a reader with nothing pulls the
version {args.full_every - 1} deltas after a full snapshot (median of 3), next to a full pull.
The emulator is fake-gcs-server (in memory, 127.0.0.1): it measures the HTTP client path
(JSON API, ranged reads, crc32c), not GCS.

{chr(10).join(trows)}

Target: the pull of the newest version at least 3x faster than a full pull.

The codec alone, on one thread, bytes in memory (median over the run's versions): encoding a
version's delta takes {med(enc):.3f} s of CPU, rebuilding it (zstd, byte planes back to
words, XOR, crc32c) {med(dec):.3f} s, that is {sizes["raw_bytes"] / MIB / med(dec):,.0f} MiB/s
of rebuilt weights per core.

## Trainer-sampler mismatch of bfloat16 versions

The workers sampled in float32 from the bfloat16 versions while the trainer recomputed the
log-probs with its float32 master weights (`trainer.old_logprobs=recompute`): per step, the
trainer's metrics (median over the {args.steps} steps, min / max). With a bfloat16 sampler
the published dtype adds nothing (tests/tpu_jobs/test_alignment.py: bit-identical batches).

| metric | median | min / max |
|---|---:|---:|
{align}

## All timings (s)

{chr(10).join(raw)}
"""
    path.write_text(text)
    path.with_suffix(".json").write_text(
        json.dumps(
            {
                "rows": rows,
                "sizes": sizes,
                "alignment": alignment,
                "timings": timings,
                "meta": meta,
            },  # fmt: skip
            indent=1,
        )
    )
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--full-every", type=int, default=10)
    parser.add_argument("--entropy-coef", type=float, default=0.01)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--root", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--no-gcs", action="store_true")
    parser.add_argument("--note", default="", help="a paragraph for the results file")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    root = Path(tempfile.mkdtemp(prefix="ps-deltas-", dir=args.root))
    emulator = None
    try:
        t0 = time.time()
        run = rl_run(args, root)
        rl_wall = time.time() - t0
        rows, sizes = version_stats(run, args.steps)
        records = run.read_metrics("train")
        keys = ("logprob_absdiff_mean", "logprob_absdiff_max", "is_ratio_mean", "is_ratio_max")
        on_policy = [r for r in records if r.get("staleness") == 0]
        alignment = {k: [float(r[k]) for r in on_policy if k in r] for k in keys}
        meta = {
            "note": args.note,
            "lr": run.config.trainer.lr,
            "warmup": run.config.trainer.warmup_steps,
            "rl_wall_s": rl_wall,
            "reward_mean": float(np.mean([r["reward_mean"] for r in records])),
            "load": load,
        }
        timings = {
            "local": bench_backend(
                "local",
                lambda name: LocalStore(root / "bench" / name),
                run,
                args.steps,
                args.full_every,
            )
        }
        if not args.no_gcs:
            from benchmarks.emulated_gcs import gcs_client, start_emulator

            emulator, url = start_emulator(root)
            client = gcs_client(url)
            client.create_bucket("rlax-bench")
            timings["fake-gcs-server"] = bench_backend(
                "emulator",
                lambda name: GCSStore("rlax-bench", f"deltas/{name}", client=client),
                run,
                args.steps,
                args.full_every,
            )
        print(write_report(args, rows, sizes, alignment, timings, meta, Path(args.out)))
    finally:
        if emulator is not None:
            emulator.terminate()
            emulator.wait()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
