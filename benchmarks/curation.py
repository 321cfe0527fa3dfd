"""Curation job throughput and peak memory on synthetic GSM8K-style rows.

    .venv/bin/python benchmarks/curation.py [--rows 100000 200000] [--workers 1]

For each size: writes N rows (10% planted near-duplicates: one word changed, 1% exact
duplicates) into 8 JSONL files plus a 500-problem eval set, runs
`python -m beam_jobs.curate` on the local FnApiRunner in a fresh process, and samples
the RSS of that process and all its children (SDK workers) every 100 ms. Writes the
table to benchmarks/results/curation.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "curation.md"
FILES = 8


def _vocab(rng: np.random.Generator, n: int = 20000) -> np.ndarray:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = rng.integers(3, 9, n)
    return np.array(["".join(rng.choice(letters, k)) for k in lengths])


def write_data(root: Path, rows: int, seed: int = 0) -> dict[str, int]:
    """N rows: 89% distinct problems, 10% near-duplicates of them, 1% exact copies."""
    rng = np.random.default_rng(seed)
    vocab = _vocab(rng)
    n_near, n_exact = rows // 10, rows // 100
    n_base = rows - n_near - n_exact
    words = rng.integers(0, len(vocab), size=(n_base, 40))
    base = [" ".join(vocab[w]) + "?" for w in words]
    texts = list(base)
    for i in rng.choice(n_base, n_near, replace=False):
        w = vocab[words[i]].copy()
        w[20] = "changed"
        texts.append(" ".join(w) + "?")
    texts += [base[i] for i in rng.choice(n_base, n_exact, replace=False)]
    order = rng.permutation(len(texts))
    (root / "in").mkdir(parents=True)
    handles = [open(root / "in" / f"part-{k}.jsonl", "w") for k in range(FILES)]  # noqa: SIM115
    for j, i in enumerate(order):
        answer = int(rng.integers(1, 10**6))
        handles[j % FILES].write(
            json.dumps({"question": "How many " + texts[i], "answer": f"Work.\n#### {answer:,}"})
            + "\n"
        )
    for h in handles:
        h.close()
    (root / "eval").mkdir()
    with open(root / "eval" / "bench_eval.jsonl", "w") as f:
        for _ in range(500):
            q = " ".join(vocab[rng.integers(0, len(vocab), 40)])
            f.write(json.dumps({"question": q, "answer": "#### 1"}) + "\n")
    return {"rows": len(texts), "near": n_near, "exact": n_exact}


class PeakRSS:
    """Samples the summed RSS of a process tree."""

    def __init__(self, pid: int, every: float = 0.1) -> None:
        self.proc = psutil.Process(pid)
        self.every = every
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
                total = 0
                for p in procs:
                    with contextlib.suppress(psutil.Error):
                        total += p.memory_info().rss
                self.peak = max(self.peak, total)
            except psutil.Error:
                pass
            time.sleep(self.every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_once(rows: int, workers: int, keep: bool = False) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="rlax-curation-bench-"))
    try:
        planted = write_data(tmp, rows)
        cmd = [sys.executable, "-m", "beam_jobs.curate",
               "--input", str(tmp / "in" / "*.jsonl"),
               "--eval-sets", str(tmp / "eval" / "*.jsonl"),
               "--output", str(tmp / "out")]  # fmt: skip
        if workers > 1:
            cmd += [
                "--direct_num_workers",
                str(workers),
                "--direct_running_mode",
                "multi_processing",
            ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        sampler = PeakRSS(proc.pid)
        out, _ = proc.communicate()
        wall = time.perf_counter() - start
        peak = sampler.stop()
        if proc.returncode != 0:
            raise RuntimeError(f"curation failed:\n{out[-4000:]}")
        stats = json.loads((tmp / "out" / "stats.json").read_text())
        steps = {s["step"]: s for s in stats["steps"]}
        return {
            "rows": planted["rows"],
            "workers": workers,
            "wall_s": wall,
            "rows_per_s": planted["rows"] / wall,
            "peak_rss_mib": peak / 2**20,
            "planted_near": planted["near"],
            "planted_exact": planted["exact"],
            "exact_removed": steps["exact_dedup"]["in"] - steps["exact_dedup"]["out"],
            "near_removed": steps["near_dedup"]["in"] - steps["near_dedup"]["out"],
            "kept": steps["split"]["in"],
            "load_avg_1m": os.getloadavg()[0],
        }
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000, 200_000])
    ap.add_argument("--workers", type=int, nargs="+", default=[1])
    args = ap.parse_args()
    results = []
    for workers in args.workers:
        for rows in args.rows:
            r = run_once(rows, workers)
            print(json.dumps(r), flush=True)
            results.append(r)
    lines = [
        "# Curation benchmark",
        "",
        f"`python benchmarks/curation.py --rows {' '.join(map(str, args.rows))} --workers "
        f"{' '.join(map(str, args.workers))}` on {os.cpu_count()} cores "
        f"({platform.machine()}, Python {platform.python_version()}), local FnApiRunner. "
        "Synthetic GSM8K-style rows (40 random words), 8 JSONL files, 10% planted "
        "near-duplicates (one word changed), 1% exact duplicates, 500-problem eval set. "
        "Wall time includes Python/Beam start-up (~6 s). Peak RSS is the sum over the job's "
        "process tree, sampled every 100 ms. The machine is shared: a load average above "
        "the core count means other work competed for the CPUs.",
        "",
        "| rows | workers | wall s | rows/s | peak RSS MiB | exact removed / planted "
        "| near removed / planted | kept | load avg (1 min) at end |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']:,} | {r['workers']} | {r['wall_s']:.1f} | {r['rows_per_s']:,.0f} "
            f"| {r['peak_rss_mib']:.0f} | {r['exact_removed']:,} / {r['planted_exact']:,} "
            f"| {r['near_removed']:,} / {r['planted_near']:,} | {r['kept']:,} "
            f"| {r['load_avg_1m']:.1f} |"
        )
    by_workers: dict[int, list[dict]] = {}
    for r in results:
        by_workers.setdefault(r["workers"], []).append(r)
    lines.append("")
    for workers, rs in sorted(by_workers.items()):
        rs = sorted(rs, key=lambda r: r["rows"])
        if len(rs) >= 2:
            a, b = rs[0], rs[-1]
            lines.append(
                f"- {workers} worker(s): {b['rows'] / a['rows']:.1f}x rows -> "
                f"{b['peak_rss_mib'] / a['peak_rss_mib']:.2f}x peak RSS "
                f"(+{(b['peak_rss_mib'] - a['peak_rss_mib']) * 2**20 / (b['rows'] - a['rows']):.0f} "
                "bytes per extra row)."
            )
    lines += [
        "",
        "What grows with rows: the shuffles hold 11 packed 16-byte entries per row (text "
        "hash, id hash, 9 LSH bands) and the removed rows (a side input of pass 2); text "
        "never sits in a shuffle, and writers sort at most `--spill-rows` rows in memory. "
        "With `--direct_running_mode multi_processing` every SDK worker is a process that "
        "imports Beam, pyarrow and NumPy (~300 MiB each), and the runner process's share "
        "grows faster per row than in-process mode (not investigated further); on 2 shared "
        "cores it is not faster than one in-process worker.",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
