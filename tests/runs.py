"""Shared helpers for tests that run real trainer/worker processes on tiny runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from pipeline.config import RunConfig, load_config
from pipeline.leases import BatchLeases
from pipeline.ops import launcher
from pipeline.paramserver import ParamServer
from pipeline.problem_sets import write_data
from pipeline.rollouts import RolloutBatch, to_parquet_bytes
from pipeline.run import Run

ROOT = Path(__file__).resolve().parents[1]


def xla_flags_with_devices(n: int) -> str:
    """XLA_FLAGS for a child process with `n` fake CPU devices, keeping the flags this
    process was given (the portability lane's `--xla_cpu_max_isa` cap must reach it)."""
    import os

    kept = os.environ.get("XLA_FLAGS", "")
    return f"{kept} --xla_force_host_platform_device_count={n}".strip()


def tiny_config(*overrides: str) -> RunConfig:
    return load_config(ROOT / "configs/tiny.yaml", list(overrides))


def with_algorithm(cfg: RunConfig, algorithm: str, **trainer_changes) -> RunConfig:
    """`cfg` with `trainer.algorithm` (and other trainer fields) changed; an objective that
    reads a teacher gets one (a Learner never opens it: it reads the batch's
    teacher_logprobs), any other has none."""
    from pipeline import algorithms
    from pipeline.distill import DistillConfig

    trainer = replace(cfg.trainer, algorithm=algorithm, **trainer_changes)
    spec = algorithms.loss_spec(algorithm, **trainer.loss_overrides())
    distill = DistillConfig(teacher="/no/teacher/run" if spec.needs_teacher else "")
    return replace(cfg, trainer=trainer, distill=distill)


def with_teacher(batch: RolloutBatch, teacher: list | None = None) -> RolloutBatch:
    """`batch` with a teacher's log-probs: `teacher`, or the sampler's moved by -0.5, 0 and
    +0.5 nat in turn (capped at 0), so the distillation advantage takes both signs."""
    if teacher is None:
        teacher = [
            np.minimum(np.asarray(lb) + 0.5 * (np.arange(len(lb)) % 3 - 1), 0.0).tolist()
            for lb in batch.behaviour_logprobs
        ]
    return replace(batch, teacher_logprobs=teacher)


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
    train_sft(run)
    return run


# Tiny runs for comparing trainers on different meshes / process counts on the same batches.
MESH_RUN_OVERRIDES = (
    "task.num_train=64",
    "task.num_eval=8",
    "sampler.max_new_tokens=16",
    "trainer.steps=2",
    "trainer.checkpoint_every=1",
    "trainer.max_staleness=2",
    "trainer.warmup_steps=0",
)


def plain_and_variants(
    root: str, variants: Mapping[str, Sequence[str]]
) -> tuple[dict[str, Run], dict[str, np.ndarray]]:
    """Run "plain" (tiny config + MESH_RUN_OVERRIDES) with data and a random base model, and
    one clone per variant (its extra overrides) sharing them; every run has the base model
    published as v0 (for rollout workers; a trainer's re-publish is a no-op). Returns
    ({name: run}, the base model's flat tensors)."""
    from pipeline.run import base_server
    from tpu_jobs.model.state import new_model, params_to_flat

    plain = Run.create(f"{root}/plain", tiny_config(*MESH_RUN_OVERRIDES))
    write_data(plain)
    fns, params = new_model(plain.config.model, 0)
    flat = params_to_flat(fns, params)
    base = base_server(plain)
    base.publish(0, flat, epoch=base.acquire_epoch())
    runs = {"plain": plain}
    for name, overrides in variants.items():
        runs[name] = clone_run(
            plain, f"{root}/{name}", tiny_config(*MESH_RUN_OVERRIDES, *overrides)
        )
    for run in runs.values():
        ps = ParamServer(run.store)
        ps.publish(0, flat, epoch=ps.acquire_epoch())
    return runs, flat


def commit_with_random_rewards(
    batch: RolloutBatch, runs: Iterable[Run], rng: np.random.Generator
) -> RolloutBatch:
    """Commit `batch` with random rewards (a real GRPO gradient from an untrained model) as
    its index in every run; returns the committed batch."""
    batch = replace(batch, reward=rng.random(len(batch)).astype(np.float32))
    for run in runs:
        BatchLeases(run.store, ttl_seconds=30).commit_batch(
            batch.batch_index, to_parquet_bytes(batch)
        )
    return batch


def inspect_wandb(path: Path) -> list[dict]:
    """The records of a W&B offline run file (.wandb), as W&B's own reader prints them
    (`wandb leet inspect --json`, the supported reader since the datastore API went)."""
    out = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
