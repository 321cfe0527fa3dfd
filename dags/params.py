"""The Params (trigger forms) of the RLAX DAGs and the run config they make.

Imported when the DAG files are parsed, so its module level stays light: stdlib,
`pipeline.config` and the task registry. It holds no DAG (`.airflowignore`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.config import ALGORITHMS, MODEL_PRESETS, ConfigError, RunConfig, load_config
from pipeline.distill import NAMED_VERSIONS as TEACHER_NAMED_VERSIONS
from pipeline.lora import MAX_RANK as MAX_LORA_RANK
from pipeline.storage import local_path, safe_name
from pipeline.tasks import TASKS

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# Task families with a verifier: the form offers what the registry has.
TASK_FAMILIES = tuple(TASKS)
# The trainer and every worker hold an executor slot for the whole RL stage: keep
# workers + 1 within [core] parallelism (8 for `rlax demo --airflow`).
MAX_WORKERS = 16
# The Beam curation job's --schema choices (beam_jobs.schemas.SCHEMAS, plus "auto"),
# spelled out because DAG files must not import beam_jobs; tests/dags/test_params.py
# checks that the two lists agree.
SOURCE_SCHEMAS = ("auto", "rlax", "gsm8k", "math", "humaneval", "mbpp", "apps")


# --------------------------------------------------------------------- run URLs


def resolve_root(root: str) -> str:
    """A storage root as a URL: gs:// and absolute paths as given, relative paths under
    the project (the scheduler's working directory is nobody's business)."""
    root = root.strip()
    path = local_path(root)
    if path is None:  # gs://... (or another remote scheme)
        return root.rstrip("/")
    path = path.expanduser()
    return str(path if path.is_absolute() else PROJECT_ROOT / path)


# The path-like Params (JSON-schema patterns: the form refuses a bad value before the run
# starts, and `run_url_for` checks again). No ".." segment anywhere; a run id is a name
# (the run lives under the storage root), the config file a YAML file inside the project.
NO_DOTDOT = r"(?!(.*/)?\.\.(/|$))"
RUN_ID_PATTERN = rf"^$|^{NO_DOTDOT}[A-Za-z0-9][A-Za-z0-9._-]{{0,127}}$"
STORAGE_ROOT_PATTERN = (
    rf"^{NO_DOTDOT}(gs://[a-z0-9][a-z0-9._-]*(/[A-Za-z0-9._-]+)*|/?[A-Za-z0-9._-]+"
    r"(/[A-Za-z0-9._-]+)*)/?$"
)
CONFIG_FILE_PATTERN = rf"^{NO_DOTDOT}[A-Za-z0-9_][A-Za-z0-9._/-]*\.ya?ml$"
# A local path or glob, or a gs:// URL: one token (the form's textbox takes stray spaces
# and line breaks silently; a path never needs them here).
PATH_PATTERN = r"^\S+$"
OVERRIDE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.]*=.*$"
# distill.teacher_version: a named version of the teacher run, or a version number.
TEACHER_VERSION_PATTERN = rf"^({'|'.join(TEACHER_NAMED_VERSIONS)}|[0-9]+)$"

# What the form shows next to each pattern: Airflow's form checks a pattern only when
# the run is triggered and then answers with the raw JSON schema, so the rule is spelled
# out beside the field.
RUN_ID_RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128"
STORAGE_ROOT_RULE = "a directory (relative to the project, or absolute) or gs://bucket/prefix"
CONFIG_FILE_RULE = "a .yaml file inside the project, e.g. configs/tiny.yaml"
# The label of the empty choice of a dropdown (the JSON schema must list null among the
# choices for the API to accept it; `values_display` shows it by this name, not "null").
FROM_CONFIG = "(the config file's)"


def shipped_configs() -> list[str]:
    """The project's config files, relative to it: the form's suggestions."""
    return sorted(
        str(p.relative_to(PROJECT_ROOT)) for p in (PROJECT_ROOT / "configs").glob("*.yaml")
    )


def check_path_param(name: str, value: str, pattern: str, allowed: str) -> str:
    if not re.match(pattern, value):
        raise ConfigError(f"Param {name}={value!r} is invalid; allowed: {allowed}")
    return value


def run_url_for(params: Mapping[str, Any], dag_run_id: str) -> str:
    """The run's URL: `storage_root/run_id`, or `storage_root/airflow-<dag run id>` when
    `run_id` is empty (stable across task retries)."""
    run_id = check_path_param(
        "run_id",
        (params.get("run_id") or "").strip(),
        RUN_ID_PATTERN,
        "a name of letters, digits, . _ - (no '..'), or empty",
    )
    root = check_path_param(
        "storage_root",
        params.get("storage_root") or "runs",
        STORAGE_ROOT_PATTERN,
        "a directory or gs://bucket/prefix without '..' segments",
    )
    name = run_id or f"airflow-{safe_name(dag_run_id)}"
    return f"{resolve_root(root)}/{name}"


# ------------------------------------------------------------------------ Params


def rl_params() -> dict[str, Any]:
    """Params of `rlax_rl_training` (the trigger form). Null means: the config file's value.

    Every Param either has a usable default or allows null (`["null", ...]` types): Airflow's
    form stars a field whose type excludes null and keeps Trigger disabled while it is
    empty, so a form left at its defaults submits (the demo run)."""
    from airflow.sdk import Param

    def opt_int(title: str, description: str, minimum: int, maximum: int, section: str):
        return Param(
            None,
            type=["null", "integer"],
            title=title,
            description=f"{description} {minimum} to {maximum:,}. Empty: the config file's value.",
            minimum=minimum,
            maximum=maximum,
            section=section,
        )

    def opt_choice(title: str, description: str, choices: Sequence[str], section: str):
        return Param(
            None,
            type=["null", "string"],
            title=title,
            description=f"{description} Empty: the config file's.",
            enum=[None, *choices],
            values_display={"null": FROM_CONFIG},
            section=section,
        )

    def opt_path(title: str, description: str, section: str):
        return Param(
            None,
            type=["null", "string"],
            title=title,
            description=description,
            pattern=PATH_PATTERN,
            section=section,
        )

    return {
        "run_id": Param(
            None,
            type=["null", "string"],
            title="Run id",
            description=f"Name of the run under the storage root: {RUN_ID_RULE}. Empty: "
            "airflow-<dag run id>. Re-using an id resumes that run (it must have the same "
            "config).",
            pattern=RUN_ID_PATTERN,
            maxLength=128,
            section="Run",
        ),
        "storage_root": Param(
            "runs",
            type="string",
            title="Storage root",
            description=f"Where runs live: {STORAGE_ROOT_RULE}; no '..' segments.",
            minLength=1,
            pattern=STORAGE_ROOT_PATTERN,
            section="Run",
        ),
        "config_file": Param(
            "configs/demo.yaml",
            type="string",
            title="Config file",
            description=f"Run config: {CONFIG_FILE_RULE} (no '..'); the fields below "
            "override it. configs/demo.yaml is the ~10-minute demo, configs/tiny.yaml a "
            "2-minute smoke run.",
            examples=shipped_configs(),
            minLength=1,
            pattern=CONFIG_FILE_PATTERN,
            section="Run",
        ),
        "task_families": Param(
            None,
            type=["null", "array"],
            title="Task families",
            description="Verifiable task families of the problem mix (equal weights unless "
            "they match the config file's families). Empty: the config file's.",
            items={"type": "string", "enum": list(TASK_FAMILIES)},
            minItems=1,
            uniqueItems=True,
            section="Data",
        ),
        "source_data": opt_path(
            "Source data (glob)",
            "Raw problem files (a local path or glob, or gs://...; no spaces) to curate with "
            "the Beam job `python -m beam_jobs.curate`; its train/validation splits become "
            "the run's data. Empty: synthetic problems from the config's task mix.",
            "Data",
        ),
        "model_preset": opt_choice("Model preset", "Named model size.", MODEL_PRESETS, "Model"),
        "hf_checkpoint": opt_path(
            "HF checkpoint path",
            "Local Hugging Face checkpoint directory (no spaces): imported as the base model "
            "(`python -m tpu_jobs.hf import`) instead of the SFT bootstrap; the model "
            "section is taken from it. Empty: SFT bootstrap.",
            "Model",
        ),
        "lora_rank": opt_int(
            "LoRA rank",
            "Train LoRA adapters of this rank on a frozen base instead of every weight "
            "(0: full RL; lora.alpha, lora.targets and a ~10x larger trainer.lr go in the "
            "overrides):",
            0,
            MAX_LORA_RANK,
            "Model",
        ),
        "algorithm": opt_choice("Algorithm", "RL algorithm.", ALGORITHMS, "RL"),
        "steps": opt_int("RL steps", "Trainer steps:", 1, 10_000_000, "RL"),
        # On-policy distillation (pipeline.distill): the config's own checks refuse a
        # teacher without an objective that reads one, and the reverse.
        "teacher": opt_path(
            "Teacher run",
            "On-policy distillation: the teacher run's URL (a directory, relative to the "
            "project or absolute, or gs://...; no spaces), with Algorithm opd or a "
            "Distillation coefficient > 0; it must share the run's tokenizer. Empty: the "
            "config file's (none: no teacher).",
            "Distillation",
        ),
        "teacher_version": Param(
            None,
            type=["null", "string"],
            title="Teacher version",
            description="Which snapshot of the teacher run: latest (its newest version "
            "when the run pins it), base (its base model), or a version number. Empty: the "
            "config file's (latest).",
            pattern=TEACHER_VERSION_PATTERN,
            section="Distillation",
        ),
        "distill_coef": Param(
            None,
            type=["null", "number"],
            title="Distillation coefficient",
            description="Mixed mode: this weight times the distillation advantage "
            "-(log pi_old - log pi_teacher) is added to the RL algorithm's advantage; 0 "
            "off (with Algorithm opd the distillation advantage is the whole objective: "
            "leave this empty or 0). 0 or more. Empty: the config file's.",
            minimum=0,
            section="Distillation",
        ),
        "workers": opt_int(
            "Rollout workers",
            "Rollout worker tasks running next to the trainer:",
            1,
            MAX_WORKERS,
            "RL",
        ),
        "max_staleness": opt_int(
            "Max staleness", "Policy versions a batch may lag (0: on-policy):", 0, 64, "RL"
        ),
        "eval_k": opt_int(
            "Eval k", "Samples per held-out problem; reports pass@1 and pass@k:", 1, 256, "Eval"
        ),
        "eval_every": opt_int(
            "Evaluate every Nth version",
            "Evaluate versions 0, N, 2N, ... and the last one:",
            1,
            100_000,
            "Eval",
        ),
        "overrides": Param(
            None,
            type=["null", "array"],
            title="Config overrides",
            description="Dotted overrides applied last, one per line, e.g. "
            "trainer.lr=1e-4 or trainer.checkpoint_every=2. Empty: none.",
            items={"type": "string", "pattern": OVERRIDE_PATTERN},
            section="Run",
        ),
    }


def config_from_params(params: Mapping[str, Any], model_overrides: Sequence[str] = ()) -> RunConfig:
    """The run config: config file, then the typed Params, then model overrides taken from
    an HF checkpoint, then the free-form dotted overrides. Raises ConfigError."""
    name = check_path_param(
        "config_file",
        params.get("config_file") or "configs/demo.yaml",
        CONFIG_FILE_PATTERN,
        "a .yaml file relative to the project, without '..'",
    )
    path = Path(name)
    if not path.is_absolute():
        path = PROJECT_ROOT / path
    if not path.is_file():  # the form cannot know the files: checked by the first task
        raise ConfigError(
            f"Param config_file={name!r}: no such file in the project; its configs: "
            + ", ".join(shipped_configs())
        )
    base = load_config(path)
    extra: dict[str, Any] = {
        "storage": {"root": resolve_root(params.get("storage_root") or "runs")}
    }
    families = params.get("task_families")
    if families:
        families = list(families)
        task: dict[str, Any] = {"families": families}
        if tuple(families) != base.task.families:
            task["weights"] = [1.0] * len(families)
        extra["task"] = task
    if params.get("model_preset"):
        extra["model"] = {"preset": params["model_preset"]}
    if params.get("lora_rank") is not None:
        extra["lora"] = {"rank": params["lora_rank"]}
    trainer: dict[str, Any] = {}
    for param, field in (("algorithm", "algorithm"), ("steps", "steps")):
        if params.get(param) is not None:
            trainer[field] = params[param]
    if params.get("max_staleness") is not None:
        trainer["max_staleness"] = params["max_staleness"]
    if params.get("distill_coef") is not None:
        trainer["distill_coef"] = params["distill_coef"]
    if trainer:
        extra["trainer"] = trainer
    distill: dict[str, Any] = {}
    if params.get("teacher"):
        distill["teacher"] = resolve_root(params["teacher"])
    if params.get("teacher_version"):
        distill["teacher_version"] = str(params["teacher_version"])
    if distill:
        extra["distill"] = distill
    if params.get("workers") is not None:
        extra["workers"] = params["workers"]
    if params.get("eval_k") is not None:
        k = int(params["eval_k"])
        extra["eval"] = {"num_samples": k, "ks": sorted({1, k})}
    overrides = [*model_overrides, *(params.get("overrides") or ())]
    return load_config(path, overrides, extra=extra)
