"""The layout of a run: every key and prefix under a run's URL, defined here only.

Stdlib only, so the DAG files (parsed by Airflow's DAG processor) and other light modules
import it without pyarrow or numpy; `pipeline.run` re-exports it.
"""

CONFIG_KEY = "config.json"  # the frozen RunConfig (`Run.create`)
DATA_PREFIX = "data"  # data/{train,eval}.parquet: the problem sets (`data_key`)
CURATED_PREFIX = "curated"  # a Beam curation job's output (pipeline.problem_sets)
BASE_PREFIX = "base"  # the base model: a parameter server of its own, version 0
ORM_PREFIX = "orm"  # the ORM baseline (tpu_jobs.orm): a parameter server of its own
HF_PREFIX = "hf"  # under base/: the imported checkpoint's config.json and tokenizer files
# under base/: a PEFT adapter imported as a LoRA run's starting adapters (`tpu_jobs.hf import
# --adapter`), version 0 of a parameter server of its own, so base/ v0 stays the bare base.
START_ADAPTER_PREFIX = "start_adapter"
# weights/: the policy's parameter server (pipeline.paramserver owns its inner layout,
# also under base/).
ROLLOUTS_PREFIX = "rollouts"  # batches and their leases (pipeline.rollouts)
METRICS_PREFIX = "metrics"  # metrics/<stream>/<index>.json (`Run.log_metrics`)
CHECKPOINTS_PREFIX = "checkpoints"  # the trainer's Orbax checkpoints
# Content manifests of the trainer's verified checkpoints (tpu_jobs/learning/checkpoints.py).
CHECKPOINT_MANIFESTS = "checkpoint_manifests"
PASS_RATES_PREFIX = "pass_rates"  # tpu_jobs.pass_rates
REPORT_PREFIX = "report"  # report.md and its plots (pipeline.report)
# tracking/<sink>/run.json: the experiment tracker's run id (create-only), cursor.json: the
# records already logged to it (pipeline.tracking).
TRACKING_PREFIX = "tracking"
DONE_KEY = "trainer/DONE.json"  # written by the trainer when its last step is done
ABORT_KEY = "airflow/ABORT.json"  # the RL stage gave up for good (pipeline.abort)
LINEAGE_KEY = "lineage.json"  # a retraining child's pinned base (pipeline.lineage)
SPLITS = ("train", "eval")


def worker_ids(n: int) -> list[str]:
    """The names of a run's `n` rollout workers (their leases and logs carry them)."""
    return [f"worker{i}" for i in range(n)]
