"""The RL stage every training DAG shares: train + rollout workers >> orm >> evaluate >> report.

Every task starts its job through `pipeline.ops.launcher` (the same command a laptop run or a
cluster pod runs), which streams the job's output into the task log and fails the task
when the job fails. Tasks hand each other the run URL through XCom, never arrays: the run
directory (or bucket prefix) is the only shared state.

Recovery: long tasks retry with exponential backoff, and a retried task resumes: the
trainer from its newest Orbax checkpoint, rollout workers re-claim expired leases, and
batches, weight versions and metrics are create-only, so a retry never writes twice. A
task whose last retry failed writes the run's abort marker (`pipeline.abort`), and its
partners stop instead of waiting for it.

Imported when the DAG files are parsed: its module level is stdlib only; everything else
is imported inside the task bodies. It holds no DAG (`.airflowignore`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

# The trainer's and the rollout workers' Celery queues (each served by its own workers, so
# where a role runs is configuration, not luck); a stdlib-only module.
from pipeline.queues import ROLLOUT_QUEUE, TRAINER_QUEUE


def _env_float(name: str, default: float, minimum: float) -> float:
    try:
        return max(minimum, float(os.environ.get(name, default)))
    except ValueError:
        return default


# Read when the DAG files are parsed (so by the DAG processor): tests shorten the delay.
RETRIES = int(_env_float("RLAX_AIRFLOW_RETRIES", 3, 2))
RETRY_DELAY = timedelta(seconds=_env_float("RLAX_AIRFLOW_RETRY_DELAY_S", 30, 1))

# Every task that runs a job: retries with exponential backoff (30 s, 60 s, 120 s, ...).
LONG_TASK: dict[str, Any] = {
    "retries": RETRIES,
    "retry_delay": RETRY_DELAY,
    "retry_exponential_backoff": 2.0,
    "max_retry_delay": timedelta(minutes=30),
}
DEFAULT_ARGS: dict[str, Any] = {"owner": "rlax", "depends_on_past": False, **LONG_TASK}
TAG = "[airflow]"


def run_role(role: str, run_url: str, extra: tuple[str, ...] = (), **kw: Any) -> None:
    """The job of `role` for the run, streamed into the task log."""
    from pipeline.ops import launcher

    launcher.stream_role(role, run_url, extra, tag=TAG, **kw)


def run_command(cmd: list[str], *, name: str, **kw: Any) -> None:
    """A job without a role (curation, HF import), streamed into the task log."""
    from pipeline.ops import launcher

    launcher.stream(cmd, name=name, tag=TAG, **kw)


def _try_info() -> tuple[bool, bool]:
    """(first try of this round, last try) of the running task instance.

    A round starts when the task is scheduled or cleared: try numbers first..max_tries+1.
    """
    from airflow.sdk import get_current_context

    ctx = get_current_context()
    ti = ctx["ti"]
    retries = int(getattr(ctx["task"], "retries", 0) or 0)
    max_tries = int(getattr(ti, "max_tries", retries) or retries)
    try_number = int(ti.try_number or 1)
    return try_number == max_tries - retries + 1, try_number > max_tries


def _partner_body(
    run_url: str, role: str, name: str, who: str, extra: tuple[str, ...] = ()
) -> None:
    """The trainer or a rollout worker: each runs until the trainer is done, stops when
    the run is aborted, and aborts the run when its own last try fails."""
    from airflow.sdk.exceptions import AirflowFailException

    from pipeline.abort import clear_stale_abort, read_abort, write_abort
    from pipeline.ops.launcher import JobFailed, JobStopped
    from pipeline.run import Run

    run = Run.open(run_url)
    first, last = _try_info()
    if first:
        clear_stale_abort(run.store)
    try:
        run_role(role, run_url, extra, name=name, stop_when=lambda: read_abort(run.store))
    except JobStopped as err:
        if read_abort(run.store):
            raise AirflowFailException(str(err)) from err  # the run was aborted: no retry
        raise
    except JobFailed as err:
        if last:
            write_abort(run.store, f"{who} failed on its last try: {err}")
        raise


def _trainer_done(run_url: str) -> str | None:
    from pipeline.run import DONE_KEY, Run

    store = Run.open(run_url).store
    return store.read(DONE_KEY).decode() if store.exists(DONE_KEY) else None


def train_body(run_url: str) -> str:
    """The trainer: skip if done, else run it (resuming from its newest checkpoint)."""
    done = _trainer_done(run_url)
    if done:
        print(f"{TAG} trainer already done: {done}")
        return run_url
    _partner_body(run_url, "train", "trainer", "trainer")
    return run_url


def rollout_body(run_url: str, worker_id: str) -> str:
    """One rollout worker; it exits by itself once the trainer has written DONE."""
    if _trainer_done(run_url):
        print(f"{TAG} trainer already done; worker {worker_id} has nothing to do")
        return worker_id
    who = f"rollout worker {worker_id}"
    _partner_body(run_url, "rollout", worker_id, who, ("--worker-id", worker_id))
    return worker_id


def evaluate_body(run_url: str, every: int) -> str:
    run_role("eval", run_url, ("--version", "all", "--every", str(every)), name="evaluator")
    return run_url


def report_body(run_url: str, keep_existing: bool = False) -> str:
    """Write the report and log its headline table (pass@1 and pass@k per version); with
    `keep_existing`, a finished run's report is left as it is (it is written after its
    evaluation, so it is complete: a re-run writes nothing)."""
    from pipeline.report import REPORT_KEY

    extra = ("--summary", "--keep-existing") if keep_existing else ("--summary",)
    run_role("report", run_url, extra, name="report")
    print(f"{TAG} the report with its plots: the Report tab of this DAG run")
    return f"{run_url}/{REPORT_KEY}"


# The run's outputs as Airflow assets: each successful task records an asset event whose
# `extra` names the run and what it made, listed under Assets in the UI. The asset is one
# per DAG and kind (a run's URL is known only at run time, so it travels in the event).
OUTPUT_KINDS = ("weights", "eval", "report")


def output_assets(dag_id: str) -> dict[str, Any]:
    """{kind: Asset} of `dag_id`'s run outputs (the `x-` scheme: Airflow's custom URIs)."""
    from airflow.sdk import Asset

    return {
        kind: Asset(name=f"{dag_id}.{kind}", uri=f"x-rlax://{dag_id}/{kind}", group="rlax")
        for kind in OUTPUT_KINDS
    }


def output_extra(kind: str, run_url: str) -> dict[str, Any]:
    """The asset event's `extra` for one kind of output of the run at `run_url`."""
    import json

    from pipeline.report import REPORT_KEY
    from pipeline.run import DONE_KEY, Run

    run = Run.open(run_url)
    extra: dict[str, Any] = {"run": run_url}
    if kind == "weights" and run.store.exists(DONE_KEY):
        done = json.loads(run.store.read(DONE_KEY))
        extra.update(step=done.get("step"), version=done.get("version"))
    elif kind in ("eval", "report"):
        evals = sorted(run.read_metrics("eval"), key=lambda e: e["version"])
        extra["versions"] = [e["version"] for e in evals]
        if evals and "pass@1" in evals[-1]["metrics"]:
            extra["pass@1"] = {
                f"v{e['version']}": round(e["metrics"]["pass@1"]["mean"], 4)
                for e in (evals[0], evals[-1])
                if "pass@1" in e["metrics"]
            }
        if kind == "report":
            extra["report"] = run.store.url_of(REPORT_KEY)
    return extra


def record_output(asset: Any, kind: str, run_url: str) -> None:
    """Attach `output_extra` to this task's event for `asset` (written when it succeeds)."""
    from airflow.sdk import get_current_context

    get_current_context()["outlet_events"][asset].extra = output_extra(kind, run_url)


def add_rl_stage(
    run_url,
    ids,
    dag_id: str,
    eval_every_param: str = "eval_every",
    keep_report: bool = False,
):
    """Add train + rollout_worker[ids] (concurrent) >> evaluate >> report to the current DAG.

    `run_url` is an XComArg (str); `ids` the XComArg of the task that makes the run ready
    for training (it returns the worker ids to map over), so train starts after it.
    `dag_id` names the run-output assets (`output_assets`) the tasks record events for.
    Returns the report task's XComArg (the report's URL).
    """
    from airflow.sdk import get_current_context, task

    assets = output_assets(dag_id)

    @task(task_id="train", queue=TRAINER_QUEUE, outlets=[assets["weights"]])
    def train(run_url: str) -> str:
        """The RL trainer; waits for its process. A retry resumes from its checkpoint."""
        out = train_body(run_url)
        record_output(assets["weights"], "weights", run_url)
        return out

    @task(task_id="rollout_worker", map_index_template="{{ worker_id }}", queue=ROLLOUT_QUEUE)
    def rollout_worker(run_url: str, worker_id: str) -> str:
        """One rollout worker (mapped over worker ids); exits when the trainer is done."""
        get_current_context()["worker_id"] = worker_id  # type: ignore[typeddict-unknown-key]
        return rollout_body(run_url, worker_id)

    @task(task_id="evaluate", outlets=[assets["eval"]])
    def evaluate(run_url: str) -> str:
        """Held-out evaluation of every published version (`--version all`)."""
        from pipeline.run import Run

        every = get_current_context()["params"].get(eval_every_param)
        out = evaluate_body(run_url, int(every or Run.open(run_url).config.eval.every))
        record_output(assets["eval"], "eval", run_url)
        return out

    @task(task_id="orm")
    def orm(run_url: str) -> str:
        """The ORM baseline (external verifier) on the run's labelled rollouts, when the
        config's eval.orm is on; otherwise nothing."""
        from pipeline.run import Run

        if Run.open(run_url).config.eval.orm:
            run_role("orm", run_url, name="orm")
        else:
            print("[airflow] eval.orm is off: no ORM baseline")
        return run_url

    @task(task_id="report", outlets=[assets["report"]])
    def report(run_url: str) -> str:
        """report/report.md and its plots; logs the headline table (pass@1, pass@k)."""
        out = report_body(run_url, keep_existing=keep_report)
        record_output(assets["report"], "report", run_url)
        return out

    trained = train(run_url)
    ids >> trained
    workers = rollout_worker.partial(run_url=run_url).expand(worker_id=ids)
    evaluated = evaluate(orm(trained))
    workers >> evaluated
    return report(evaluated)
