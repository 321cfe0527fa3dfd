"""### RLAX: weekly retraining (`rlax_retraining`)

`curate` -> `prepare` -> (`train` -> `orm` || `rollout_worker` x N) -> `evaluate` -> `report` -> `register`

Every week (logical date D), curate the new source data of D and continue RL training
from the latest published snapshot of a named run (the *parent*):

* **curate**: `python -m beam_jobs.curate` on the files matching *Source data* (with
  `{ds}` replaced by D), decontaminated against the parent's held-out set, into the
  child run `RETRAIN_ROOT/YYYYMMDD/curated`. No files for D: the run is skipped.
* **prepare**: create the child run (the parent's config + Params), make the curated
  train split its training data and the parent's held-out set its eval set (so scores
  compare across weeks), pin its base (`lineage.json`: the final snapshot of the newest
  completed earlier week when *Chain* is on, else the parent's latest version) and copy
  that snapshot to the child's `base/` (where the trainer starts).
* **train** || **rollout_worker**, **evaluate**, **report**: as in `rlax_rl_training`.
* **register**: record the child's final version in `RETRAIN_ROOT/_lineage/YYYYMMDD.json`
  for the next week to chain from.

Idempotent per logical date: the curation finds its `_SUCCESS`, the base stays pinned,
data/weights/metrics are create-only, a finished trainer is not restarted, evaluated
versions and a finished run's report are kept: re-running D writes nothing. Runs one date at a
time (`max_active_runs=1`), so weeks chain in order. See docs/airflow.md.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import Param, dag, get_current_context, task

from dags.params import MAX_WORKERS, OVERRIDE_PATTERN, SOURCE_SCHEMAS, resolve_root
from dags.stage import DEFAULT_ARGS, add_rl_stage, run_command
from pipeline.lineage import (
    LineageError,
    child_url,
    default_retrain_root,
    eval_set_url,
    prepare_child,
    register,
    render_source,
    worker_ids_of,
)


def _where() -> tuple[str, str, str]:
    """(logical date YYYY-MM-DD, parent run URL, retrain root) of the running task."""
    ctx = get_current_context()
    when = ctx.get("logical_date") or ctx["dag_run"].run_after  # manual runs may lack one
    params = ctx["params"]
    parent = resolve_root(params["parent_run"])
    root = resolve_root(params.get("retrain_root") or default_retrain_root(parent))
    return when.strftime("%Y-%m-%d"), parent, root


@dag(
    dag_id="rlax_retraining",
    schedule="0 3 * * 1",  # Mondays 03:00 UTC: the week that just ended
    start_date=datetime(2026, 1, 5),
    catchup=False,
    max_active_runs=1,
    # Scheduled: a fresh Airflow must not start a training run nobody asked for (the
    # triggered-only DAGs start unpaused; see docs/airflow.md, "Paused at creation").
    is_paused_upon_creation=True,
    tags=["rlax", "rl", "retraining", "weekly"],
    doc_md=__doc__,
    default_args=DEFAULT_ARGS,
    params={
        "parent_run": Param(
            "runs/rlax-main",
            type="string",
            minLength=1,
            title="Parent run",
            description="The named run to continue from (relative to the project, an "
            "absolute path or gs://bucket/prefix).",
        ),
        "source_data": Param(
            "data/incoming/{ds}/*.jsonl",
            type="string",
            minLength=1,
            title="Source data (glob)",
            description="New raw problems of the logical date; {ds} (YYYY-MM-DD) and "
            "{ds_nodash} are replaced by it.",
        ),
        "source_schema": Param(
            "auto", type="string", enum=list(SOURCE_SCHEMAS), title="Source schema"
        ),
        "retrain_root": Param(
            None,
            type=["null", "string"],
            title="Retrain root",
            description="Where the weekly child runs go. Empty: <parent run>-retrain.",
        ),
        "chain": Param(
            True,
            type="boolean",
            title="Chain",
            description="Continue from the newest completed earlier week (else always from "
            "the parent's latest version).",
        ),
        "steps": Param(
            None,
            type=["null", "integer"],
            minimum=1,
            title="RL steps",
            description="Trainer steps per week. Empty: the parent's.",
        ),
        "workers": Param(
            None,
            type=["null", "integer"],
            minimum=1,
            maximum=MAX_WORKERS,
            title="Rollout workers",
            description="Empty: the parent's.",
        ),
        "eval_every": Param(5, type="integer", minimum=1, title="Evaluate every Nth version"),
        "overrides": Param(
            None,
            type=["null", "array"],
            items={"type": "string", "pattern": OVERRIDE_PATTERN},
            title="Config overrides",
            description="Dotted overrides of the child's config, e.g. trainer.lr=2e-5.",
        ),
    },
)
def rlax_retraining():
    @task(task_id="curate")
    def curate() -> str:
        """Curate the logical date's new data into the child run; skip if there is none."""
        from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

        from pipeline import storage
        from pipeline.ops import launcher
        from pipeline.ops.launcher import JobFailed
        from pipeline.run import CURATED_PREFIX, Run, RunError

        ds, parent_url, root = _where()
        params = get_current_context()["params"]
        url = child_url(root, ds)
        try:
            if Run.open(url).has_problems("train"):  # a re-run of this date: nothing to do
                print(f"[airflow] {url} already has its curated data")
                return url
        except RunError:
            pass
        source = resolve_root(render_source(params["source_data"], ds))
        if not storage.glob(os.path.expanduser(source)):
            raise AirflowSkipException(f"no new source data for {ds}: nothing matches {source}")
        try:
            parent = Run.open(parent_url)
        except RunError as err:
            raise AirflowFailException(str(err)) from err
        cmd = launcher.curate_command(
            [source],
            f"{url}/{CURATED_PREFIX}",
            eval_sets=[eval_set_url(parent)],
            options={"schema": params["source_schema"], "seed": parent.config.seed},
        )
        try:
            run_command(cmd, name="curate")
        except JobFailed as err:
            if err.returncode == 2:  # bad arguments, or the date's output holds other inputs
                raise AirflowFailException(str(err)) from err
            raise
        return url

    @task(task_id="prepare")
    def prepare(url: str) -> list[str]:
        """Child run: config, curated data, parent's eval set, pinned base snapshot."""
        from airflow.sdk.exceptions import AirflowFailException

        from pipeline.config import ConfigError
        from pipeline.run import RunError

        ds, parent_url, root = _where()
        params = get_current_context()["params"]
        try:
            child = prepare_child(parent_url, root, ds, params, chain=params["chain"])
        except (LineageError, ConfigError, RunError, ValueError) as err:
            raise AirflowFailException(str(err)) from err
        assert child.url == url, (child.url, url)
        print(f"[airflow] child run {url}: base {child.store.read('lineage.json').decode()}")
        return list(worker_ids_of(child))

    @task(task_id="register")
    def register_child(report_url: str) -> dict:
        """Record the child's final snapshot for the following weeks."""
        ds, _, root = _where()
        record = register(root, ds, child_url(root, ds))
        print(f"[airflow] registered {record}")
        return record

    url = curate()
    report = add_rl_stage(url, prepare(url), dag_id="rlax_retraining", keep_report=True)
    register_child(report)


retraining_dag = rlax_retraining()
