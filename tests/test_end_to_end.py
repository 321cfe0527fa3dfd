"""A tiny run end to end: SFT, then a trainer and a rollout worker as separate processes
meeting only through the run directory, then evaluation and the report."""

import contextlib
import json
import os
import time
from pathlib import Path

from pipeline.config import load_config
from pipeline.ops import launcher
from pipeline.paramserver import ParamServer
from pipeline.problem_sets import write_data
from pipeline.rollouts import from_parquet_bytes
from pipeline.run import DONE_KEY, Run
from tests.runs import inspect_wandb

ROOT = Path(__file__).resolve().parents[1]


def _wait(procs, timeout):
    """Wait for all to exit; stop early if one fails."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return
        time.sleep(0.5)


def test_tiny_run_trainer_and_worker_processes(tmp_path):
    t0 = time.time()
    cfg = load_config(ROOT / "configs/tiny.yaml", ["sft.steps=20"])
    run = Run.create(str(tmp_path / "run"), cfg)
    write_data(run)
    logs = tmp_path / "logs"
    assert launcher.start("sft", run.url, log_path=logs / "sft.log").wait(120) == 0
    trainer = launcher.start("train", run.url, log_path=logs / "trainer.log")
    worker = launcher.start("rollout", run.url, ("--worker-id", "w0"), log_path=logs / "w0.log")
    try:
        _wait([trainer, worker], 100)
    finally:
        for p in (trainer, worker):
            if p.poll() is None:
                p.kill()
    out = (logs / "trainer.log").read_text() + (logs / "w0.log").read_text()
    assert trainer.returncode == 0 and worker.returncode == 0, out

    steps = cfg.trainer.steps
    done = json.loads(run.store.read(DONE_KEY))
    assert done["step"] == steps and done["dropped"] == 0
    # Every batch index produced exactly once, in order, by the worker, each with its
    # pinned version and a full set of G samples per prompt.
    keys = run.store.list("rollouts/")
    assert [k for k in keys if k.endswith(".parquet")] == [
        f"rollouts/b{i:08d}.parquet" for i in range(steps)
    ]
    for i in range(steps):
        b = from_parquet_bytes(run.store.read(f"rollouts/b{i:08d}.parquet"))
        assert b.batch_index == i and b.worker_id == "w0"
        assert len(b) == cfg.rollout.prompts_per_batch * cfg.rollout.group_size
        assert b.policy_version == max(0, i - cfg.trainer.max_staleness)
        assert all(0.0 <= r <= 1.0 for r in b.reward)
    assert ParamServer(run.store).versions() == list(range(steps + 1))
    train = sorted(run.read_metrics("train"), key=lambda r: r["step"])
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(abs(r["loss"]) < 1e3 for r in train)

    assert launcher.run_job("eval", run.url, ["--version", "0," + str(steps)]) == 0
    evals = sorted(run.read_metrics("eval"), key=lambda r: r["version"])
    assert [e["version"] for e in evals] == [0, steps]
    for e in evals:
        for m in e["metrics"].values():
            assert 0.0 <= m["lo"] <= m["mean"] <= m["hi"] <= 1.0
    from pipeline.report import build_report

    md = build_report(run)
    assert "pass@1" in md and "maj@4" in md
    assert len(run.store.read("report/curves.png")) > 1000
    assert time.time() - t0 < 120
    _tracked_in_wandb_as_recorded(run, tmp_path / "wandb")


def _tracked_in_wandb_as_recorded(run: Run, wandb_dir: Path) -> None:
    """This real run's records, exported to W&B offline (tests/pipeline/test_tracking.py
    checks every field and the resume on planted records; here the roles wrote them): the
    trainer's loss and reward per step, the rollout reward per committed batch and the
    evaluator's pass@1 with its interval per version, read back with W&B's own reader."""
    from pipeline.config import override_section
    from pipeline.tracking import export

    cfg = override_section(
        run.config.tracking,
        "tracking",
        [
            "tracking.backends=[wandb]",
            "tracking.wandb_mode=offline",
            f"tracking.wandb_dir={wandb_dir}",
        ],
    )
    with _env(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(wandb_dir)):
        logged = export(run, cfg, log=print)
    (path,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    got: dict[str, set[tuple[float, float]]] = {}
    for rec in inspect_wandb(path):
        if rec["type"] == "history":
            item = rec["history"]["item"]
            axes = [a for a in ("train/step", "eval/version", "rollout/batch_index") if a in item]
            if not axes:
                continue  # another stream (SFT's steps): not compared here
            x = item[axes[0]]
            for tag, value in item.items():
                got.setdefault(tag, set()).add((float(x), float(value)))
    want: dict[str, set[tuple[float, float]]] = {}
    for r in run.read_metrics("train"):
        for f in ("loss", "reward_mean"):
            want.setdefault(f"train/{f}", set()).add((r["step"], r[f]))
    for r in run.read_metrics("eval"):
        for end, key in (("", "mean"), ("/lo", "lo"), ("/hi", "hi")):
            want.setdefault(f"eval/pass_at_1{end}", set()).add(
                (r["version"], r["metrics"]["pass@1"][key])
            )
    rollouts = [r for r in run.read_metrics("rollout") if r.get("committed", True)]
    for r in rollouts:
        want.setdefault("rollout/reward_mean", set()).add((r["batch_index"], r["reward_mean"]))
    assert logged["wandb"] >= len(want["train/loss"]) + 2 + len(rollouts)  # + SFT's
    for tag, points in want.items():
        assert got[tag] == {(float(x), float(v)) for x, v in points}, tag


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
