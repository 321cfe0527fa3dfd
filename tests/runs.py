"""Shared helpers for tests that run real trainer/worker processes on tiny runs."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from pipeline import launcher
from pipeline.config import RunConfig, load_config
from pipeline.demo import write_data
from pipeline.paramserver import ParamServer
from pipeline.run import Run

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(*overrides: str) -> RunConfig:
    return load_config(ROOT / "configs/tiny.yaml", list(overrides))


def clone_run(
    src: Run, url: str, cfg: RunConfig | None = None, prefixes: tuple[str, ...] = ("data/", "base/")
) -> Run:
    """A new run sharing `src`'s data and base model (and optionally its batches)."""
    dst = Run.create(url, cfg or src.config)
    for prefix in prefixes:
        for key in src.store.list(prefix):
            dst.store.write_new(key, src.store.read(key))
    return dst


def start(run: Run, name: str, logs: Path, env: dict[str, str] | None = None):
    role, extra = ("train", ()) if name == "trainer" else ("rollout", ("--worker-id", name))
    import os
    import subprocess

    cmd = launcher.job_command(role, run.url, extra)
    logs.mkdir(parents=True, exist_ok=True)
    out = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
    return subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )


def wait_all(procs: dict, timeout: float) -> dict[str, int | None]:
    """Wait until all exit or one fails; kill leftovers; return exit codes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        codes = {n: p.poll() for n, p in procs.items()}
        if all(c is not None for c in codes.values()) or any(
            c not in (None, 0) for c in codes.values()
        ):
            break
        time.sleep(0.2)
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    return {n: p.returncode for n, p in procs.items()}


def final_tensors(run: Run) -> tuple[int, dict[str, np.ndarray]]:
    ps = ParamServer(run.store)
    v = ps.latest_version()
    return v, {k: np.array(t) for k, t in ps.pull(v).tensors.items()}


def assert_bit_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def make_base(url: str, cfg: RunConfig) -> Run:
    """A run with data and an SFT'd base model (SFT in this process)."""
    from tpu_jobs.sft import train_sft

    run = Run.create(url, cfg)
    write_data(run)
    train_sft(run, log_every=10_000)
    return run
