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
EVAL_PREFIX = "eval"  # the evaluator's per-sample results (`eval_key`)
# The evaluation of a run's pinned teacher (on-policy distillation): its samples under this
# name beside the versions' (`eval_key`), its record in the stream `teacher_stream`.
TEACHER_EVAL = "teacher"
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


def eval_key(
    subject: int | str,
    num_samples: int | None = None,
    default_samples: int | None = None,
    dataset: str | None = None,
) -> str:
    """Per-sample results of evaluating `subject` (a weight version, or TEACHER_EVAL: the
    run's pinned teacher); an n other than the config's, or a built-in dataset instead of
    the held-out set, gets its own key."""
    name = f"v{subject:08d}" if isinstance(subject, int) else subject
    suffix = "" if num_samples is None or num_samples == default_samples else f"-n{num_samples}"
    named = f"-{dataset}" if dataset else ""
    return f"{EVAL_PREFIX}/{name}{named}{suffix}.parquet"


def eval_stream(
    num_samples: int, ks, default_samples: int, default_ks, dataset: str | None = None
) -> str:
    """Metrics stream of an evaluation: "eval" (or "eval-{dataset}") for the config's
    (n, ks), else its own."""
    ks = tuple(int(k) for k in ks)
    base = f"{EVAL_PREFIX}-{dataset}" if dataset else EVAL_PREFIX
    if num_samples == default_samples and ks == tuple(default_ks):
        return base
    return f"{base}-n{num_samples}-k" + "_".join(map(str, ks))


def teacher_stream(stream: str) -> str:
    """The stream of the teacher's record of evaluation `stream` (one record, index 0). It
    starts with TEACHER_EVAL, so no reader of the versions' "eval*" streams takes it for
    one of them."""
    return f"{TEACHER_EVAL}-{stream}"
