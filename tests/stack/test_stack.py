"""The production shape for real (`rlax stack`, docs/deployment.md), marked `stack`: not in
`make test`; `.ci/run` runs it afterwards (`pytest -m stack tests/stack`).

* The stack comes up on 127.0.0.1: PostgreSQL, Redis, Airflow 3 with the Celery executor
  (api-server, scheduler, dag-processor, two Celery workers), fake-gcs-server, the sandbox
  service and a Dask cluster of two workers; nothing listens beyond loopback.
* `rlax_rl_training` runs through it, triggered and followed with the official
  `apache-airflow-client`, on a gs:// run URL; the trainer's task runs on Celery worker 1,
  the rollout workers' on worker 2 (their queues; their processes descend from them).
* Deployment-level preemption: Celery worker 2 is SIGKILLed, with everything it started,
  while a rollout worker holds a lease; then PostgreSQL is restarted; then Celery worker 1
  is SIGKILLed while the trainer runs past its first checkpoint. The killed workers are
  restarted (`rlax stack up`), Airflow's heartbeat timeout fails the lost tries and its
  retries run them again; the run succeeds with final parameters bit-identical to an
  uninterrupted run of the same config, 0 batches lost and 0 produced twice.
* The Beam curation job on the DaskRunner against the stack's Dask cluster writes output
  byte-identical to the local FnApiRunner's.
* `rlax stack down` leaves no process of the stack behind.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest

from pipeline.leases import BatchLeases
from pipeline.ops import chaos, processes
from pipeline.ops import stack as stack_mod
from pipeline.ops.airflow_local import RL_DAG_ID
from pipeline.ops.airflow_rest import AirflowAPI
from pipeline.run import CHECKPOINT_MANIFESTS, DONE_KEY, Run

pytestmark = [pytest.mark.stack, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 14
WORKERS = 2
HEARTBEAT_TIMEOUT_S = 20  # a task without heartbeats for this long is failed and retried
LEASE_SECONDS = 10
REPORT: dict[str, object] = {}


def _say(text: str) -> None:
    print(f"[stack-test] {text}", flush=True)


@pytest.fixture(scope="module")
def stack():
    # Under the project, not pytest's private tmp: PostgreSQL runs as its own user (as
    # root) and must reach its data directory.
    parent = ROOT / ".cache"
    parent.mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="stack-test-", dir=parent))
    mp = pytest.MonkeyPatch()
    mp.setenv("RLAX_AIRFLOW_RETRY_DELAY_S", "2")
    mp.setenv("RLAX_STACK_HEARTBEAT_TIMEOUT_S", str(HEARTBEAT_TIMEOUT_S))
    mp.setenv("RLAX_STACK_ROLLOUT_SLOTS", str(WORKERS + 1))
    t0 = time.monotonic()
    try:
        st = stack_mod.up(root, log=_say)
        REPORT["stack_up_s"] = round(time.monotonic() - t0, 1)
        for key, value in st.gcs_env().items():  # this process reaches the bucket too
            mp.setenv(key, value)
        yield st
    finally:
        started = [info["pid"] for info in stack_mod.Stack.load(root).procs.values()]
        t1 = time.monotonic()
        stack_mod.down(root, log=_say)
        REPORT["stack_down_s"] = round(time.monotonic() - t1, 1)
        mp.undo()
        _say(f"report: {REPORT}")
        left = [p for p in started if psutil.pid_exists(p) and processes.start_time(p)]
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes of the stack still running after down: {left}"


def test_stack_is_healthy_and_listens_on_loopback_only(stack):
    rows = stack_mod.status(stack.root)
    expected = {s.name for s in stack_mod.SERVICES if s.available() is None}
    assert {r["service"] for r in rows if r["healthy"]} == expected, rows
    listening: dict[int, str] = {}
    for name, info in stack.procs.items():
        for pid in [info["pid"], *processes.descendants(info["pid"])]:
            try:
                conns = psutil.Process(pid).net_connections(kind="inet")
            except psutil.Error:
                continue
            for c in conns:
                if c.status == psutil.CONN_LISTEN:
                    listening[c.laddr.port] = f"{name}:{c.laddr.ip}"
    assert listening, "nothing listening?"
    wide = {port: who for port, who in listening.items() if not who.endswith(":127.0.0.1")}
    assert not wide, f"listening beyond 127.0.0.1: {wide}"
    assert (stack.root / stack_mod.SECRETS_FILE).stat().st_mode & 0o077 == 0


class _Timeline:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.events: list[tuple[float, str]] = []

    def __call__(self, what: str) -> float:
        t = round(time.monotonic() - self.t0, 1)
        self.events.append((t, what))
        _say(f"{t:6.1f}s {what}")
        return t


def _tis(api: AirflowAPI, dag_run: str) -> dict[tuple[str, int], object]:
    return {(t.task_id, t.map_index): t for t in api.task_instances(RL_DAG_ID, dag_run)}


def _under(stack, service: str, pid: int | None) -> bool:
    """`pid` runs under the service's process now (the state file has restarted ones)."""
    info = stack_mod.Stack.load(stack.root).procs.get(service)
    return bool(pid and info) and pid in processes.descendants(info["pid"])


def _airflow_pids(stack) -> dict[str, int]:
    """The running api-server, scheduler and DAG processor: service -> pid."""
    procs = stack_mod.Stack.load(stack.root).procs
    names = ("airflow-api-server", "airflow-scheduler", "airflow-dag-processor")
    return {n: procs[n]["pid"] for n in names if processes.start_time(procs[n]["pid"])}


def _heartbeat_after(health: dict, when: datetime) -> bool:
    beat = (health.get("scheduler") or {}).get("latest_scheduler_heartbeat")
    if beat is None:
        return False
    if isinstance(beat, str):
        beat = datetime.fromisoformat(beat)
    return beat > when


def _soon(probe, within_s: float = 5.0):
    """`probe()`'s first truthy value, polled closely for a while (a batch or a trainer
    step takes about a second, less than the main loop's round of API calls)."""
    deadline = time.monotonic() + within_s
    while not (found := probe()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def _live_lease_soon(run: Run) -> list:
    return _soon(BatchLeases(run.store, ttl_seconds=LEASE_SECONDS).live_leases)


def _tries(history: list) -> list[tuple[int, str, str]]:
    return [(t.try_number, getattr(t.state, "value", t.state), t.hostname) for t in history]


def test_rl_run_through_celery_survives_preemption_and_db_restart(stack):
    api = AirflowAPI(stack.api_url, stack_mod.ADMIN, stack.secrets["admin_password"])
    api.wait_for_dag(RL_DAG_ID, timeout=240)
    name = f"stack-{uuid.uuid4().hex[:8]}"
    runs = f"gs://{stack_mod.BUCKET}/runs"
    conf = {
        "run_id": name,
        "storage_root": runs,
        "config_file": "configs/tiny.yaml",
        "steps": STEPS,
        "workers": WORKERS,
        "eval_every": 1000,  # v0 and the last version
        "overrides": [
            "trainer.checkpoint_every=2",
            "sft.steps=4",  # this run is about recovery, not the model's quality
            "eval.num_problems=8",
            "eval.bootstrap=50",
            f"rollout.lease_seconds={LEASE_SECONDS}",
        ],
    }
    at = _Timeline()
    dag_run = api.trigger(RL_DAG_ID, conf)
    at(f"triggered {dag_run} -> {runs}/{name}")
    run = None
    routed = trainer_killed = trainer_back = db_restarted = rollout_killed = rollout_back = None
    deadline = time.monotonic() + 720
    state = "queued"
    while state not in ("success", "failed"):
        assert time.monotonic() < deadline, f"run still {state}; events {at.events}"
        time.sleep(1.0)
        state = api.dag_run(RL_DAG_ID, dag_run).state
        tis = _tis(api, dag_run)
        train = tis.get(("train", -1))
        rollouts = [t for (task, _), t in tis.items() if task == "rollout_worker"]
        if run is None:
            try:
                run = Run.open(f"{runs}/{name}")
            except Exception:  # noqa: BLE001 - not created yet
                continue
        done = run.store.exists(DONE_KEY)
        all_running = bool(train) and len(rollouts) == WORKERS
        all_running = all_running and all(
            t.state == "running" and t.pid for t in [train, *rollouts]
        )
        if routed is None and all_running:
            # Each task's process descends from the Celery worker of its queue.
            assert _under(stack, "airflow-worker-1", train.pid), train
            assert all(_under(stack, "airflow-worker-2", t.pid) for t in rollouts)
            assert train.queue == "trainer" and {t.queue for t in rollouts} == {"rollout"}
            assert train.hostname.startswith("worker1@"), train.hostname
            assert all(t.hostname.startswith("worker2@") for t in rollouts)
            routed = at("routing: train on worker1 (queue trainer), rollouts on worker2")
        # The rollout kill comes first, at the run's start: a worker's first lease is live
        # for as long as its sampler compiles (seconds on any machine), and the trainer
        # cannot move without batches, so it cannot finish before the kills that follow.
        # (Killed last, the rollout workers could have nothing left to lease: on a fast
        # machine the retried trainer ran its last 8 steps within one 5 s lease poll.)
        if routed and rollout_killed is None:
            assert not done, f"trainer done before a rollout kill: raise STEPS; {at.events}"
            leases = _live_lease_soon(run)
            if leases:
                killed = stack_mod.Stack.load(stack.root).preempt("airflow-worker-2")
                rollout_killed = at(
                    f"SIGKILL Celery worker 2 ({len(killed)} processes) while "
                    f"{sorted(le.worker_id for le in leases)} held leases"
                )
                stack_mod.up(stack.root, log=lambda _: None)
                at("Celery worker 2 restarted")
        if rollout_killed and db_restarted is None:
            airflow_pids = _airflow_pids(stack)
            t = time.monotonic()
            stack_mod.restart("postgres", stack.root, log=lambda _: None)
            restarted_at = datetime.now(UTC)
            down_s = time.monotonic() - t
            # The scheduler reconnected when it records a heartbeat after the restart.
            while not _heartbeat_after(api.health(), restarted_at):
                assert time.monotonic() - t < 120, "no scheduler heartbeat after the restart"
                time.sleep(0.5)
            db_restarted = at(
                f"PostgreSQL restarted in {down_s:.1f}s; the scheduler heartbeats again "
                f"{time.monotonic() - t:.1f}s after the restart began"
            )
        if db_restarted and trainer_killed is None:
            assert not done, f"trainer done before it could be killed: raise STEPS; {at.events}"
            # Killed at its first checkpoint, the trainer has most of its steps left.
            checkpoint = train.state == "running" and _soon(
                functools.partial(run.store.list, f"{CHECKPOINT_MANIFESTS}/")
            )
            if checkpoint:
                steps = len(run.store.list("metrics/train/"))
                killed = stack_mod.Stack.load(stack.root).preempt("airflow-worker-1")
                trainer_killed = at(
                    f"SIGKILL Celery worker 1 ({len(killed)} processes) at trainer step {steps}"
                )
                stack_mod.up(stack.root, log=lambda _: None)  # the node comes back
                at("Celery worker 1 restarted")
        # A retried trainer seen running under the restarted worker, or already finished
        # there (its last steps can take less than one poll).
        retried = bool(trainer_killed) and train.try_number >= 2
        is_back = retried and (
            (train.state == "running" and _under(stack, "airflow-worker-1", train.pid))
            or train.state == "success"
        )
        if is_back and trainer_back is None:
            trainer_back = at(
                f"train try {train.try_number} {getattr(train.state, 'value', train.state)} "
                f"on {train.hostname}"
            )
        if rollout_killed and rollout_back is None:
            back = [t for t in rollouts if t.try_number >= 2 and t.state in ("running", "success")]
            if len(back) == WORKERS:
                rollout_back = at(
                    "rollout workers on try " + ", ".join(str(t.try_number) for t in back)
                )
    wall = at(f"DAG run {getattr(state, 'value', state)}")
    assert state == "success", _explain(api, dag_run)
    assert None not in (routed, trainer_killed, trainer_back, db_restarted, rollout_killed)
    # The same Airflow processes ran on across the database restart: they reconnected.
    assert _airflow_pids(stack) == airflow_pids

    # The tries: the lost ones failed on the killed worker, the retries ran on the restarted.
    tries = {
        label: api.tries(RL_DAG_ID, dag_run, task, index)
        for label, (task, index) in {
            "train": ("train", -1),
            **{f"rollout[{i}]": ("rollout_worker", i) for i in range(WORKERS)},
        }.items()
    }
    for label, history in tries.items():
        summary = _tries(history)
        _say(f"{label} tries: {summary}")
        assert len(history) >= 2 and history[0].state == "failed", summary
        assert history[-1].state == "success", summary
    assert all(t.hostname.startswith("worker1@") for t in tries["train"])
    # The retried trainer resumed from its checkpoint rather than starting over.
    last = api.task_log(RL_DAG_ID, dag_run, "train", tries["train"][-1].try_number)
    assert "resumed from checkpoint" in last, last[-3000:]
    assert "starting from the base model" not in last

    # The chaos guarantees: every batch once, and the parameters of an uninterrupted run.
    batches = chaos.batch_accounting(run)
    batches.pop("attempts")
    assert batches["batches_consumed"] == STEPS, batches
    assert batches["batches_lost"] == 0 and batches["batches_produced_twice"] == 0, batches
    trained = sorted(
        int(k.rsplit("/", 1)[1].split(".")[0]) for k in run.store.list("metrics/train/")
    )
    assert trained == list(range(1, STEPS + 1))
    t = time.monotonic()
    reference = Run.create(f"{runs}/{name}-reference", run.config)
    chaos.clone_inputs(run, reference)
    chaos.run_uninterrupted(reference, WORKERS, timeout_s=300)
    same, comparison = chaos.final_params_equal(reference, run)
    assert same, comparison
    REPORT.update(
        run_wall_s=wall,
        events=at.events,
        tries={k: _tries(v) for k, v in tries.items()},
        trainer_recovery_s=round(trainer_back - trainer_killed, 1),
        rollout_recovery_s=round((rollout_back or wall) - rollout_killed, 1),
        batches=batches,
        reference_wall_s=round(time.monotonic() - t, 1),
        comparison=comparison,
    )


def _explain(api: AirflowAPI, dag_run: str) -> str:
    return "\n".join(
        f"{t.task_id}[{t.map_index}] {t.state} try {t.try_number} on {t.hostname}"
        for t in api.task_instances(RL_DAG_ID, dag_run)
    )


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_beam_curation_on_dask_is_byte_identical_to_the_local_runner(stack, tmp_path):
    from beam_jobs import curate
    from tests.beam_jobs.fixtures import write_fixture
    from tests.beam_jobs.test_curate import args_for

    write_fixture(tmp_path)
    t = time.monotonic()
    curate.run(curate.parse_args(args_for(tmp_path, str(tmp_path / "local"))))
    local_s = time.monotonic() - t
    dask_args = [
        "--runner=beam_jobs.dask_runner.DaskRunner",
        f"--dask_client_address={stack.dask_address}",
    ]
    t = time.monotonic()
    try:
        curate.run(curate.parse_args(args_for(tmp_path, str(tmp_path / "dask"), *dask_args)))
    finally:  # the runner's client, left open by Beam, would outlive the cluster noisily
        from distributed import default_client

        with contextlib.suppress(ValueError):
            default_client().close()
    dask_s = time.monotonic() - t
    local, dask = _files(tmp_path / "local"), _files(tmp_path / "dask")
    assert sorted(local) == sorted(dask)
    assert any(k.startswith("train/part-") for k in local)
    differ = [k for k in local if local[k] != dask[k]]
    assert not differ, differ
    # The job ran on the cluster: both of its workers executed tasks.
    from distributed import Client

    with Client(stack.dask_address, timeout=30) as client:
        executed = client.run(lambda dask_worker: dask_worker.state.transition_counter)
    assert len(executed) == 2 and all(n > 0 for n in executed.values()), executed
    REPORT.update(curate_local_s=round(local_s, 1), curate_dask_s=round(dask_s, 1))
