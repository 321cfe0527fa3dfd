"""### RLAX: RL training of a language model, end to end (`rlax_rl_training`)

`curate` -> `bootstrap` -> (`train` -> `orm` || `rollout_worker` x N) -> `evaluate` -> `report`

* **curate**: create the run (config file + the Params of the trigger form) and write its
  problem data: synthetic problems from the task mix, or, when *Source data* is set, the
  train/validation splits of the Beam curation job (`python -m beam_jobs.curate`).
* **bootstrap**: the base model: SFT on a noisy teacher (`tpu_jobs.sft`), or, when *HF
  checkpoint path* is set, an import of that checkpoint (`python -m tpu_jobs.hf import`).
* **train** and **rollout_worker** (one mapped task per worker id) run *concurrently*:
  the trainer consumes rollout batches and publishes weight versions; workers claim
  batch leases, sample with the newest allowed version and commit batches; they exit when
  the trainer has written `trainer/DONE.json`.
* **orm**: the ORM baseline when the config's `eval.orm` is on (docs/evaluation.md).
* **evaluate**: every published version (`--version all`, every *N*th plus the last).
* **report**: `report/report.md` + `report/curves.png` in the run directory.

Tasks pass only the run URL through XCom. Each task starts its job as a process (the
command line of `pipeline.ops.launcher`), streams its output into the task log and fails
with it. Retries (exponential backoff) resume: the trainer from its newest checkpoint,
workers by re-claiming leases; batches and versions are create-only. The trainer and all
workers hold an executor slot for the whole RL stage: keep workers + 1 within
`[core] parallelism`. See docs/airflow.md.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, get_current_context, task

from dags.params import config_from_params, rl_params, run_url_for
from dags.stage import DEFAULT_ARGS, add_rl_stage, run_command, run_role
from pipeline.layout import worker_ids
from pipeline.ops import launcher


@dag(
    dag_id="rlax_rl_training",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    is_paused_upon_creation=False,  # triggered only: unpaused, nothing runs unasked
    tags=["rlax", "rl", "training"],
    doc_md=__doc__,
    params=rl_params(),
    default_args=DEFAULT_ARGS,
    max_active_runs=4,
)
def rlax_rl_training():
    @task(task_id="curate")
    def curate() -> str:
        """Create the run and write its problem data (synthetic, or curated by Beam)."""
        from airflow.sdk.exceptions import AirflowFailException

        from pipeline.config import ConfigError
        from pipeline.entrypoint import BAD_INPUT
        from pipeline.ops.launcher import JobFailed
        from pipeline.run import CURATED_PREFIX, Run, RunError

        ctx = get_current_context()
        params = ctx["params"]
        url = run_url_for(params, ctx["run_id"])
        try:
            hf = params.get("hf_checkpoint")
            cfg = config_from_params(params, launcher.hf_model_overrides(hf) if hf else ())
            run = Run.create(url, cfg)
        except (ConfigError, RunError, ValueError) as err:  # a retry would fail the same way
            raise AirflowFailException(str(err)) from err
        print(f"[airflow] run {url} (config digest {cfg.digest()})")
        source = params.get("source_data")
        if source and not (run.has_problems("train") and run.has_problems("eval")):
            out = run.store.url_of(CURATED_PREFIX)
            run_command(
                launcher.curate_command([source], out, options={"seed": cfg.seed}), name="curate"
            )
        try:
            run_role("data", url, ("--curated",) if source else ())
        except JobFailed as err:
            if err.returncode == BAD_INPUT:  # curated data this run cannot verify, ...
                raise AirflowFailException(str(err)) from err
            raise
        return url

    @task(task_id="bootstrap")
    def bootstrap(run_url: str) -> list[str]:
        """The base model: SFT on a noisy teacher, or an HF checkpoint import."""
        from pipeline.run import Run

        run = Run.open(run_url)
        hf = get_current_context()["params"].get("hf_checkpoint")
        if hf:
            run_command(launcher.hf_import_command(hf, run_url), name="hf-import")
        else:
            run_role("sft", run_url)
        return worker_ids(run.config.workers)  # the rollout workers to map over

    run_url = curate()
    add_rl_stage(run_url, bootstrap(run_url), dag_id="rlax_rl_training")


rl_training_dag = rlax_rl_training()
