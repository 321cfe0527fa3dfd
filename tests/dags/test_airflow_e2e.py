"""rlax_rl_training under a real scheduler: `airflow standalone` (SQLite, LocalExecutor) on
127.0.0.1, two DAG runs triggered through the REST API with a conf of Params, at once:

* `e2e`: the tiny config end to end (curate -> SFT -> trainer || worker -> eval -> report),
  every task succeeding on its first try;
* `preempt`: the trainer's process is SIGKILLed mid-run; Airflow retries the task and the
  new trainer resumes from its newest Orbax checkpoint (proved by the step numbers).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from pipeline.ops.airflow_local import RL_DAG_ID, AirflowError, LocalAirflow, plain
from pipeline.run import CHECKPOINT_MANIFESTS

STEPS_PREEMPT = 16


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow_home")
    af = LocalAirflow(
        home=home,
        parallelism=8,
        # Retries after ~1 s instead of 30 s (the exponential backoff's base).
        env_extra={"RLAX_AIRFLOW_RETRY_DELAY_S": "1"},
    )
    t0 = time.monotonic()
    af.start(timeout=420)
    try:
        af.wait_for_dag(RL_DAG_ID, timeout=240)
        print(f"airflow standalone ready in {time.monotonic() - t0:.0f}s")
        yield af
    finally:
        pgid = af.proc.pid if af.proc else None
        af.stop()
        if pgid is not None:  # nothing of it is left running
            with pytest.raises(ProcessLookupError):
                os.killpg(pgid, 0)


def _trainer_process(run_dir: Path) -> psutil.Process | None:
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "tpu_jobs.trainer" in cmd and str(run_dir) in cmd:
            return proc
    return None


def _committed_checkpoints(run_dir: Path) -> list[int]:
    """Steps the trainer can resume from: committed by Orbax and verified by a content
    manifest (tpu_jobs/learning/checkpoints.py; a step without one is refused on restore)."""
    ckpt, manifests = run_dir / "checkpoints", run_dir / CHECKPOINT_MANIFESTS
    if not ckpt.is_dir() or not manifests.is_dir():
        return []
    verified = {int(p.stem) for p in manifests.glob("*.json")}
    return sorted(
        int(p.name) for p in ckpt.iterdir() if p.name.isdigit() and int(p.name) in verified
    )


def _kill_trainer_mid_run(
    af: LocalAirflow, dag_run: str, run_dir: Path, timeout: float
) -> tuple[int, int]:
    """SIGKILL the trainer once a checkpoint (step >= 2) is committed and it is not done.

    Returns (newest committed checkpoint, last logged step) at the kill. Fails at once,
    with the task logs, if the DAG run ends first."""
    deadline = time.monotonic() + timeout
    next_state_check = 0.0
    while time.monotonic() < deadline:
        done = (run_dir / "trainer" / "DONE.json").exists()
        assert not done, "the trainer finished before it could be killed: raise its steps"
        ckpts = [s for s in _committed_checkpoints(run_dir) if s >= 2]
        proc = _trainer_process(run_dir) if ckpts else None
        if proc is not None:
            steps = sorted((run_dir / "metrics" / "train").glob("*.json"))
            proc.send_signal(signal.SIGKILL)
            return ckpts[-1], int(steps[-1].stem) if steps else 0
        if time.monotonic() >= next_state_check:
            next_state_check = time.monotonic() + 5.0
            state = plain(af.dag_run(RL_DAG_ID, dag_run))["state"]
            assert state not in ("success", "failed"), (
                f"run {dag_run} ended ({state}) before its trainer could be killed:\n"
                + _explain(af, dag_run)
            )
        time.sleep(0.1)
    raise AssertionError(
        f"no trainer with a committed checkpoint in {timeout:.0f}s (checkpoints: "
        f"{_committed_checkpoints(run_dir)}):\n" + _explain(af, dag_run)
    )


def _explain(af: LocalAirflow, run_id: str) -> str:
    lines = []
    for ti in map(plain, af.task_instances(RL_DAG_ID, run_id)):
        lines.append(f"{ti['task_id']}[{ti['map_index']}] {ti['state']} try {ti['try_number']}")
        if ti["state"] not in ("success", None) and ti["try_number"]:
            log = af.task_log(RL_DAG_ID, run_id, ti["task_id"], ti["try_number"], ti["map_index"])
            lines.append(log[-2500:])
    return "\n".join(lines)


@pytest.mark.e2e  # ~2 CPU-minutes: .ci/run's e2e lane, not make test
@pytest.mark.timeout(1200)
def test_rl_training_via_rest_end_to_end_and_trainer_preemption(airflow, tmp_path):
    t0 = time.monotonic()
    root = tmp_path / "runs"
    base = {"storage_root": str(root), "config_file": "configs/tiny.yaml"}
    # The Params are validated when the run is triggered: a bad conf is refused.
    with pytest.raises(AirflowError, match="HTTP 400"):
        airflow.trigger(RL_DAG_ID, {**base, "run_id": "bad", "workers": 0})

    # configs/tiny.yaml's SFT makes a usable base model; plumbing tests shorten it.
    e2e = airflow.trigger(RL_DAG_ID, {**base, "run_id": "e2e", "overrides": ["sft.steps=20"]})
    preempt = airflow.trigger(
        RL_DAG_ID,
        {
            **base,
            "run_id": "preempt",
            "steps": STEPS_PREEMPT,  # long enough for the kill to land mid-run
            "max_staleness": 0,
            "workers": 1,
            "eval_every": 1000,  # evaluate v0 and the last version only
            # Checkpoints every 2 steps; a short SFT and a small eval: this run is about
            # the trainer's recovery, not the model's quality.
            "overrides": [
                "trainer.checkpoint_every=2",
                "sft.steps=4",
                "eval.num_problems=8",
                "eval.bootstrap=50",
            ],
        },
    )
    ckpt_at_kill, step_at_kill = _kill_trainer_mid_run(
        airflow, preempt, root / "preempt", timeout=600
    )
    t_kill = time.monotonic() - t0

    state = airflow.wait_for_run(RL_DAG_ID, e2e, timeout=600)
    assert state == "success", _explain(airflow, e2e)
    t_e2e = time.monotonic() - t0
    state = airflow.wait_for_run(RL_DAG_ID, preempt, timeout=600)
    assert state == "success", _explain(airflow, preempt)
    print(f"kill at {t_kill:.0f}s, e2e done at {t_e2e:.0f}s, all at {time.monotonic() - t0:.0f}s")

    # ---- e2e: each stage once, the data flow of the run directory complete.
    tis = {
        (t["task_id"], t["map_index"]): t
        for t in map(plain, airflow.task_instances(RL_DAG_ID, e2e))
    }
    run = root / "e2e"
    cfg = json.loads((run / "config.json").read_text())
    workers = cfg["workers"]
    assert set(tis) == {
        ("curate", -1),
        ("bootstrap", -1),
        ("train", -1),
        ("orm", -1),
        ("evaluate", -1),
        ("report", -1),
        *(("rollout_worker", i) for i in range(workers)),
    }
    assert all(t["state"] == "success" and t["try_number"] == 1 for t in tis.values()), tis
    steps = cfg["trainer"]["steps"]
    assert json.loads((run / "trainer" / "DONE.json").read_text())["step"] == steps
    evaluated = sorted(int(p.stem) for p in (run / "metrics" / "eval").glob("*.json"))
    every = cfg["eval"]["every"]  # no Evaluate-every Param in the conf: the config's
    assert evaluated == sorted({v for v in range(steps + 1) if v % every == 0} | {steps})
    report = (run / "report" / "report.md").read_text()
    assert "pass@1" in report and (run / "report" / "curves.png").stat().st_size > 1000
    train_log = airflow.task_log(RL_DAG_ID, e2e, "train", 1)
    assert f"[trainer] step {steps}/{steps}" in train_log  # the child's output, streamed
    assert tis[("report", -1)]["state"] == "success"

    # ---- preemption: the train task failed once (SIGKILL), its retry resumed.
    run = root / "preempt"
    train = next(
        t for t in map(plain, airflow.task_instances(RL_DAG_ID, preempt)) if t["task_id"] == "train"
    )
    assert train["try_number"] >= 2
    first = airflow.task_log(RL_DAG_ID, preempt, "train", 1)
    assert "killed by SIGKILL" in first
    last = airflow.task_log(RL_DAG_ID, preempt, "train", train["try_number"])
    resumed = [int(m) for m in re.findall(r"resumed from checkpoint at step (\d+)", last)]
    assert resumed, last[-3000:]
    assert 2 <= resumed[0] <= STEPS_PREEMPT - 1
    assert ckpt_at_kill <= resumed[0] <= max(step_at_kill, ckpt_at_kill) + 2
    assert "starting from the base model" not in last
    # Every step exactly once (metrics are create-only), the run complete.
    logged = sorted(int(p.stem) for p in (run / "metrics" / "train").glob("*.json"))
    assert logged == list(range(1, STEPS_PREEMPT + 1))
    assert json.loads((run / "trainer" / "DONE.json").read_text())["step"] == STEPS_PREEMPT
    assert (run / "report" / "report.md").is_file()
    # The steps after the checkpoint were trained again by the retry, the earlier ones not.
    retrained = [int(m) for m in re.findall(r"\[trainer\] step (\d+)/", last)]
    assert retrained and retrained[0] == resumed[0] + 1 and retrained[-1] == STEPS_PREEMPT
    _check_exposure(airflow)


def _check_exposure(af: LocalAirflow) -> None:
    """docs/security.md: the API and the scheduler's (unauthenticated) health server listen
    on 127.0.0.1 only; the metadata database and the task logs are the user's alone."""
    group = os.getpgid(af.proc.pid)
    listening = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) != group:
                continue
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    listening[conn.laddr.port] = conn.laddr.ip
        except (psutil.Error, ProcessLookupError):
            continue
    assert listening.get(af.port) == "127.0.0.1", listening
    health = int(airflow_env_value(af, "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT"))
    assert listening.get(health) == "127.0.0.1", listening
    assert (af.home / "airflow.db").stat().st_mode & 0o077 == 0
    logs = [p for p in (af.home / "logs").rglob("*") if p.is_file()]
    assert logs and all(p.stat().st_mode & 0o077 == 0 for p in logs)
    assert af.home.stat().st_mode & 0o077 == 0


def airflow_env_value(af: LocalAirflow, name: str) -> str:
    """A variable of the running standalone's environment (its scheduler's)."""
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == os.getpgid(af.proc.pid) and name in proc.environ():
                return proc.environ()[name]
        except (psutil.Error, ProcessLookupError):
            continue
    raise AssertionError(f"{name} not in the environment of any Airflow process")
