"""### RLAX: dataset curation (`rlax_curation`)

The Beam curation job alone, parameterised like its command line:

    python -m beam_jobs.curate --input GLOB [--input GLOB ...] --output DIR
        [--format F] [--schema S] [--eval-sets GLOB ...] [--ngram N]
        [--near-dup-threshold T] [--pass-rates GLOB ... --min-pass-rate A --max-pass-rate B]
        [--val-fraction F] [--seed N] [--max-row-bytes N] [--rows-per-shard N]
        [--spill-rows N] [--num-perm N] [--staging DIR] [--overwrite] [Beam options]

read -> parse/validate -> exact + near dedup -> decontaminate -> difficulty band ->
train/validation split -> deterministic Parquet shards + `stats.json` + `_SUCCESS`
(see docs/curation.md). Relative paths are relative to the project. The job is
idempotent: the same inputs and options find `_SUCCESS` and do nothing, so a retry
or a re-run is free. Bad arguments (exit code 2) fail the task without retries.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, get_current_context, task

from dags.params import SOURCE_SCHEMAS, resolve_root
from dags.stage import DEFAULT_ARGS, run_command
from pipeline.ops.launcher import JobFailed, curate_command

_GLOBS = {"type": "string", "minLength": 1}


@dag(
    dag_id="rlax_curation",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    is_paused_upon_creation=False,  # triggered only: unpaused, nothing runs unasked
    tags=["rlax", "data", "beam"],
    doc_md=__doc__,
    default_args=DEFAULT_ARGS,
    params={
        "input": Param(
            type="array",
            items=_GLOBS,
            minItems=1,
            title="--input",
            description="Source files (local or gs:// globs); each must match a file.",
        ),
        "output": Param(
            type="string",
            minLength=1,
            title="--output",
            description="Output directory or gs://bucket/prefix.",
        ),
        "format": Param("auto", enum=["auto", "jsonl", "parquet", "csv"], title="--format"),
        "schema": Param("auto", enum=list(SOURCE_SCHEMAS), title="--schema"),
        "eval_sets": Param(
            None,
            type=["null", "array"],
            items=_GLOBS,
            title="--eval-sets",
            description="Evaluation sets to decontaminate against (one set per file).",
        ),
        "ngram": Param(13, type="integer", minimum=1, title="--ngram"),
        "near_dup_threshold": Param(
            0.8, type="number", exclusiveMinimum=0, exclusiveMaximum=1, title="--near-dup-threshold"
        ),
        "pass_rates": Param(
            None,
            type=["null", "array"],
            items=_GLOBS,
            title="--pass-rates",
            description="Pass-rate Parquet files (`rlax pass-rates`) for the difficulty band.",
        ),
        "min_pass_rate": Param(0.1, type="number", minimum=0, maximum=1, title="--min-pass-rate"),
        "max_pass_rate": Param(0.9, type="number", minimum=0, maximum=1, title="--max-pass-rate"),
        "val_fraction": Param(
            0.05, type="number", minimum=0, exclusiveMaximum=1, title="--val-fraction"
        ),
        "seed": Param(0, type="integer", minimum=0, title="--seed"),
        "max_row_bytes": Param(65536, type="integer", minimum=64, title="--max-row-bytes"),
        "rows_per_shard": Param(100_000, type="integer", minimum=1, title="--rows-per-shard"),
        "spill_rows": Param(20_000, type="integer", minimum=1, title="--spill-rows"),
        "num_perm": Param(128, type="integer", minimum=8, maximum=1024, title="--num-perm"),
        "staging": Param(None, type=["null", "string"], title="--staging"),
        "overwrite": Param(False, type="boolean", title="--overwrite"),
        "beam_args": Param(
            None,
            type=["null", "array"],
            items={"type": "string"},
            title="Beam options",
            description="Passed through, e.g. --runner=DataflowRunner --project=P --region=R.",
        ),
    },
)
def rlax_curation():
    @task(task_id="curate")
    def curate() -> str:
        """Run `python -m beam_jobs.curate` with the Params; return the output URL."""
        from airflow.sdk.exceptions import AirflowFailException

        p = get_current_context()["params"]
        output = resolve_root(p["output"])
        options = {
            k: p[k]
            for k in (
                "format",
                "schema",
                "ngram",
                "near_dup_threshold",
                "min_pass_rate",
                "max_pass_rate",
                "val_fraction",
                "seed",
                "max_row_bytes",
                "rows_per_shard",
                "spill_rows",
                "num_perm",
                "staging",
                "overwrite",
            )
        }
        cmd = curate_command(
            p["input"],
            output,
            eval_sets=p["eval_sets"] or [],
            pass_rates=p["pass_rates"] or [],
            options=options,
            beam_args=p["beam_args"] or [],
        )
        try:
            run_command(cmd, name="curate")
        except JobFailed as err:
            if err.returncode == 2:  # bad arguments: the same on every try
                raise AirflowFailException(str(err)) from err
            raise
        return output

    curate()


curation_dag = rlax_curation()
