"""Shared pieces of the RLAX DAGs: task defaults, Params, and the task bodies.

Every task starts its job as a child process with the command line of `pipeline.launcher`
(the same command a laptop run or a cluster pod runs), streams the child's output into
the task log, and fails when the child fails. Tasks hand each other the run URL through
XCom, never arrays: the run directory (or bucket prefix) is the only shared state.

Recovery: long tasks retry with exponential backoff, and a retried task resumes: the
trainer from its newest Orbax checkpoint, rollout workers re-claim expired leases, and
batches, weight versions and metrics are create-only, so a retry never writes twice.

This module is imported when the DAG files are parsed, so its module level stays light
(stdlib, `pipeline.launcher`, `pipeline.config`): everything heavier (pyarrow through
`pipeline.run`, numpy through `pipeline.paramserver`) is imported inside the task bodies.
It holds no DAG itself (`.airflowignore` keeps the DAG processor from scanning it).
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from pipeline import launcher
from pipeline.config import ALGORITHMS, MODEL_PRESETS, ConfigError, RunConfig, load_config
from pipeline.storage import safe_name

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# Task families with a verifier (`pipeline.tasks.TASKS`; importing it here would pull in
# numpy at parse time: tests/dags check that the two agree).
TASK_FAMILIES = ("arithmetic", "countdown")
# The trainer and every worker hold an executor slot for the whole RL stage: keep
# workers + 1 within [core] parallelism (8 for `rlax demo --airflow`).
MAX_WORKERS = 16
# Key of the base model's parameter server inside a run (`tpu_jobs.sft.BASE_PREFIX`).
BASE_PREFIX = "base"
# Written when the RL stage of a run gave up for good (a task's last retry failed), so
# the other RL tasks stop instead of waiting forever for a partner that is gone.
ABORT_KEY = "airflow/ABORT.json"


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


class JobFailed(RuntimeError):
    """A job's process exited with a non-zero code (a retry may succeed)."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


class JobStopped(RuntimeError):
    """A job was stopped from outside (SIGTERM to the task, or the run was aborted)."""


# --------------------------------------------------------------------- run URLs


def resolve_root(root: str) -> str:
    """A storage root as a URL: gs:// and absolute paths as given, relative paths under
    the project (the scheduler's working directory is nobody's business)."""
    root = root.strip()
    if "://" in root:
        return root.rstrip("/")
    path = Path(root).expanduser()
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


def local_path(url: str) -> str:
    """A path for tools that take a directory or gs:// URL (Beam), not file:// URLs."""
    return url.removeprefix("file://")


# ------------------------------------------------------------------------ Params


def rl_params() -> dict[str, Any]:
    """Params of `rlax_rl_training` (the trigger form). Null means: the config file's value."""
    from airflow.sdk import Param

    def opt_int(title: str, description: str, minimum: int, maximum: int, section: str):
        return Param(
            None,
            type=["null", "integer"],
            title=title,
            description=description + " Empty: the config file's value.",
            minimum=minimum,
            maximum=maximum,
            section=section,
        )

    def opt_choice(title: str, description: str, choices: Sequence[str], section: str):
        return Param(
            None,
            type=["null", "string"],
            title=title,
            description=description + " Empty: the config file's.",
            enum=[None, *choices],
            section=section,
        )

    return {
        "run_id": Param(
            "",
            type="string",
            title="Run id",
            description="Name of the run under the storage root (letters, digits, . _ -; no "
            "'..'). Empty: airflow-<dag run id>. Re-using an id resumes that run (it must "
            "have the same config).",
            pattern=RUN_ID_PATTERN,
            section="Run",
        ),
        "storage_root": Param(
            "runs",
            type="string",
            title="Storage root",
            description="Where runs live: a directory (relative to the project) or "
            "gs://bucket/prefix (no '..' segments).",
            minLength=1,
            pattern=STORAGE_ROOT_PATTERN,
            section="Run",
        ),
        "config_file": Param(
            "configs/demo.yaml",
            type="string",
            title="Config file",
            description="Run config YAML, relative to the project (no '..'); the fields below "
            "override it.",
            examples=["configs/demo.yaml", "configs/tiny.yaml"],
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
        "source_data": Param(
            None,
            type=["null", "string"],
            title="Source data (glob)",
            description="Raw problem files (local or gs:// glob) to curate with the Beam job "
            "`python -m beam_jobs.curate`; its train/validation splits become the run's "
            "data. Empty: synthetic problems from the config's task mix.",
            section="Data",
        ),
        "model_preset": opt_choice("Model preset", "Named model size.", MODEL_PRESETS, "Model"),
        "hf_checkpoint": Param(
            None,
            type=["null", "string"],
            title="HF checkpoint path",
            description="Local Hugging Face checkpoint directory: imported as the base model "
            "(`python -m tpu_jobs.hf import`) instead of the SFT bootstrap; the model "
            "section is taken from it.",
            section="Model",
        ),
        "algorithm": opt_choice("Algorithm", "RL algorithm.", ALGORITHMS, "RL"),
        "steps": opt_int("RL steps", "Trainer steps.", 1, 10_000_000, "RL"),
        "workers": opt_int(
            "Rollout workers",
            f"Rollout worker tasks running next to the trainer (at most {MAX_WORKERS}).",
            1,
            MAX_WORKERS,
            "RL",
        ),
        "max_staleness": opt_int(
            "Max staleness", "Policy versions a batch may lag (0: on-policy).", 0, 64, "RL"
        ),
        "eval_k": opt_int(
            "Eval k", "Samples per held-out problem; reports pass@1 and pass@k.", 1, 256, "Eval"
        ),
        "eval_every": opt_int(
            "Evaluate every Nth version",
            "Evaluate versions 0, N, 2N, ... and the last one.",
            1,
            100_000,
            "Eval",
        ),
        "overrides": Param(
            [],
            type="array",
            title="Config overrides",
            description="Dotted overrides applied last, e.g. trainer.lr=1e-4 "
            "trainer.checkpoint_every=2.",
            items={"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_.]*=.*$"},
            section="Run",
        ),
    }


def config_from_params(params: Mapping[str, Any], model_overrides: Sequence[str] = ()) -> RunConfig:
    """The run config: config file, then the typed Params, then model overrides taken from
    an HF checkpoint, then the free-form dotted overrides. Raises ConfigError."""
    path = Path(
        check_path_param(
            "config_file",
            params.get("config_file") or "configs/demo.yaml",
            CONFIG_FILE_PATTERN,
            "a .yaml file relative to the project, without '..'",
        )
    )
    if not path.is_absolute():
        path = PROJECT_ROOT / path
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
    trainer: dict[str, Any] = {}
    for param, field in (("algorithm", "algorithm"), ("steps", "steps")):
        if params.get(param) is not None:
            trainer[field] = params[param]
    if params.get("max_staleness") is not None:
        trainer["max_staleness"] = params["max_staleness"]
    if trainer:
        extra["trainer"] = trainer
    if params.get("workers") is not None:
        extra["workers"] = params["workers"]
    if params.get("eval_k") is not None:
        k = int(params["eval_k"])
        extra["eval"] = {"num_samples": k, "ks": sorted({1, k})}
    overrides = [*model_overrides, *(params.get("overrides") or ())]
    return load_config(path, overrides, extra=extra)


def worker_ids(n: int) -> list[str]:
    return [f"worker{i}" for i in range(n)]


# ----------------------------------------------------------------- child processes


def _pump(stream, capture: list[str] | None) -> None:
    """Copy the child's output into the task log (the task's stdout), line by line."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        if capture is not None:
            capture.append(line)
        print(line, flush=True)


def stream_command(
    cmd: Sequence[str],
    *,
    name: str,
    stop_when: Callable[[], str | None] | None = None,
    check_every_s: float = 5.0,
    grace_s: float = 60.0,
    capture: list[str] | None = None,
) -> None:
    """Run `cmd`, copy its output into the task log line by line, raise if it fails.

    `stop_when()` is polled every `check_every_s`; a non-empty answer stops the job
    (SIGTERM, then SIGKILL after `grace_s`) and raises JobStopped with it. A SIGTERM to
    the task (Airflow stopping it, a node being drained) stops the job the same way.
    """
    print(f"[airflow] starting {name}: {shlex.join(cmd)}", flush=True)
    # Its own process group (stopped as a whole), SIGTERM if the task process dies.
    proc = launcher.spawn(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=launcher.job_env(),
        cwd=PROJECT_ROOT,
    )
    reader = threading.Thread(target=_pump, args=(proc.stdout, capture), daemon=True)
    reader.start()
    stopped: list[str] = []
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stopped.append("task got SIGTERM"))
    try:
        next_check = time.monotonic() + check_every_s
        while proc.poll() is None and not stopped:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1.0)
            if stop_when is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + check_every_s
                why = stop_when()
                if why:
                    stopped.append(why)
    finally:
        if proc.poll() is None:
            launcher.stop_group(proc.pid, grace_s, reap=proc)
        reader.join(10)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if stopped:
        raise JobStopped(f"{name} stopped: {stopped[0]} (exit code {proc.returncode})")
    if proc.returncode != 0:
        how = (
            f"was killed by {signal.Signals(-proc.returncode).name}"
            if proc.returncode < 0
            else f"exited with code {proc.returncode}"
        )
        raise JobFailed(f"{name} {how}; its output is above", proc.returncode)


def run_role(
    role: str, run_url: str, extra: Sequence[str] = (), *, name: str | None = None, **kw: Any
) -> None:
    """Run a launcher role (sft/train/rollout/eval) as a child process of this task."""
    stream_command(launcher.job_command(role, run_url, extra), name=name or role, **kw)


# -------------------------------------------------------------------- curation


def curate_command(
    inputs: Iterable[str],
    output: str,
    *,
    eval_sets: Iterable[str] = (),
    pass_rates: Iterable[str] = (),
    options: Mapping[str, Any] | None = None,
    beam_args: Iterable[str] = (),
) -> list[str]:
    """`python -m beam_jobs.curate --input G ... --output DIR [--flag value ...]`.

    `options` maps CLI flags without dashes (`near_dup_threshold`) to values; None is
    left out (the job's default), True is a bare flag, False is left out.
    """
    args: list[str] = []
    for pattern in inputs:
        args += ["--input", pattern]
    args += ["--output", output]
    for pattern in eval_sets:
        args += ["--eval-sets", pattern]
    for pattern in pass_rates:
        args += ["--pass-rates", pattern]
    for key, value in (options or {}).items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return launcher.module_command("beam_jobs.curate", [*args, *beam_args])


def glob_has_matches(pattern: str) -> bool:
    """Whether a local or gs:// glob matches at least one file."""
    if not pattern.startswith("gs://"):
        return any(Path(p).is_file() for p in glob.glob(os.path.expanduser(pattern)))
    from pipeline.storage import open_store

    bucket, _, path = pattern[len("gs://") :].partition("/")
    fixed = re.split(r"[*?\[]", path, maxsplit=1)[0]
    prefix = fixed.rsplit("/", 1)[0] if "/" in fixed else ""
    store = open_store(f"gs://{bucket}/{prefix}".rstrip("/"))
    rest = path[len(prefix) :].lstrip("/")
    return any(fnmatch.fnmatchcase(key, rest) for key in store.list(""))


def read_curated(store, split: str) -> list:
    """Problems of one split of a curated output (`train`/`validation` shards)."""
    import io

    import pyarrow.parquet as pq

    from pipeline.tasks.base import Problem

    problems = []
    for key in store.list(f"{split}/"):
        if key.endswith(".parquet"):
            for row in pq.read_table(io.BytesIO(store.read(key))).to_pylist():
                problems.append(Problem.from_dict(row))
    return problems


def check_families(problems: list, families: Sequence[str], where: str) -> None:
    from collections import Counter

    unknown = Counter(p.task for p in problems if p.task not in families)
    if unknown:
        raise ValueError(
            f"{where}: {sum(unknown.values())} problems of task families "
            f"{dict(unknown)} have no verifier in this run; allowed families: "
            f"{', '.join(families)} (set task_families / task.families)"
        )


def write_curated_data(run, curated_prefix: str = "curated", eval_from=None) -> tuple[int, int]:
    """Make a curated output (under the run's store) the run's train/eval problem sets.

    The held-out set is the curated validation split, or `eval_from` (a list of
    Problems, e.g. a parent run's held-out set, so versions stay comparable)."""
    if run.has_problems("train") and run.has_problems("eval"):
        return len(run.read_problems("train")), len(run.read_problems("eval"))
    curated = run.store.child(curated_prefix)
    families = run.config.task.families
    train = read_curated(curated, "train")
    held_out = eval_from if eval_from is not None else read_curated(curated, "validation")
    if not train or not held_out:
        raise ValueError(
            f"curated data under {curated.url} has {len(train)} train and {len(held_out)} "
            "held-out problems; both must be non-empty (more source rows, or a larger "
            "--val-fraction)"
        )
    check_families(train, families, "curated train split")
    check_families(held_out, families, "held-out set")
    eval_ids = {p.problem_id for p in held_out}
    train = [p for p in train if p.problem_id not in eval_ids]
    run.write_problems("eval", held_out)
    run.write_problems("train", train)
    return len(train), len(held_out)


# ------------------------------------------------------------------ abort marker


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


def read_abort(store) -> str | None:
    from pipeline.storage import ObjectNotFound

    try:
        return json.loads(store.read(ABORT_KEY)).get("reason", "aborted")
    except ObjectNotFound:
        return None


def write_abort(store, reason: str) -> None:
    store.write_new(ABORT_KEY, json.dumps({"reason": reason, "time": time.time()}).encode())


def clear_stale_abort(store) -> None:
    from pipeline.storage import ObjectNotFound

    with contextlib.suppress(ObjectNotFound):
        store.delete(ABORT_KEY)


# ------------------------------------------------------------------- task bodies


def train_body(run_url: str) -> str:
    """The trainer: skip if done, else run it (resuming from its newest checkpoint)."""
    from airflow.sdk.exceptions import AirflowFailException

    from pipeline.run import DONE_KEY, Run

    run = Run.open(run_url)
    if run.store.exists(DONE_KEY):
        print(f"[airflow] trainer already done: {run.store.read(DONE_KEY).decode()}")
        return run_url
    first, last = _try_info()
    if first:
        clear_stale_abort(run.store)
    try:
        run_role("train", run_url, name="trainer", stop_when=lambda: read_abort(run.store))
    except JobStopped as err:
        if read_abort(run.store):
            raise AirflowFailException(str(err)) from err  # the run was aborted: no retry
        raise
    except JobFailed as err:
        if last:
            write_abort(run.store, f"trainer failed on its last try: {err}")
        raise
    return run_url


def rollout_body(run_url: str, worker_id: str) -> str:
    """One rollout worker; it exits by itself once the trainer has written DONE."""
    from airflow.sdk.exceptions import AirflowFailException

    from pipeline.run import DONE_KEY, Run

    run = Run.open(run_url)
    if run.store.exists(DONE_KEY):
        print(f"[airflow] trainer already done; worker {worker_id} has nothing to do")
        return worker_id
    first, last = _try_info()
    if first:
        clear_stale_abort(run.store)
    try:
        run_role(
            "rollout",
            run_url,
            ("--worker-id", worker_id),
            name=worker_id,
            stop_when=lambda: read_abort(run.store),
        )
    except JobStopped as err:
        if read_abort(run.store):
            raise AirflowFailException(str(err)) from err
        raise
    except JobFailed as err:
        if last:
            write_abort(run.store, f"rollout worker {worker_id} failed on its last try: {err}")
        raise
    return worker_id


def evaluate_body(run_url: str, every: int) -> str:
    run_role("eval", run_url, ("--version", "all", "--every", str(every)), name="evaluator")
    return run_url


def report_body(run_url: str, keep_existing: bool = False) -> str:
    """Write the report; with `keep_existing`, a finished run's report is left as it is
    (it is written after its evaluation, so it is complete: a re-run writes nothing)."""
    from pipeline.report import build_report
    from pipeline.run import DONE_KEY, Run

    run = Run.open(run_url)
    where = f"{run_url}/report/report.md"
    if keep_existing and run.store.exists(DONE_KEY) and run.store.exists("report/report.md"):
        print(f"[airflow] report already written: {where}")
        return where
    print(build_report(run))
    print(f"[airflow] report: {where}")
    return where


def hf_model_overrides(path: str) -> list[str]:
    """The `model.*` overrides matching an HF checkpoint (`python -m tpu_jobs.hf config`)."""
    cmd = launcher.module_command("tpu_jobs.hf", ["config", path])
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=launcher.job_env(), cwd=PROJECT_ROOT
    )
    if done.returncode != 0:
        raise ValueError(f"cannot read HF checkpoint {path!r}: {done.stderr.strip()[-2000:]}")
    return done.stdout.split()


def add_rl_stage(run_url, ids, eval_every_param: str = "eval_every", keep_report: bool = False):
    """Add train + rollout_worker[ids] (concurrent) >> evaluate >> report to the current DAG.

    `run_url` is an XComArg (str); `ids` the XComArg of the task that makes the run ready
    for training (it returns the worker ids to map over), so train starts after it.
    Returns the report task's XComArg (the report's URL).
    """
    from airflow.sdk import get_current_context, task

    @task(task_id="train")
    def train(run_url: str) -> str:
        """The RL trainer; waits for its process. A retry resumes from its checkpoint."""
        return train_body(run_url)

    @task(task_id="rollout_worker", map_index_template="{{ worker_id }}")
    def rollout_worker(run_url: str, worker_id: str) -> str:
        """One rollout worker (mapped over worker ids); exits when the trainer is done."""
        get_current_context()["worker_id"] = worker_id  # type: ignore[typeddict-unknown-key]
        return rollout_body(run_url, worker_id)

    @task(task_id="evaluate")
    def evaluate(run_url: str) -> str:
        """Held-out evaluation of every published version (`--version all`)."""
        from pipeline.run import Run

        every = get_current_context()["params"].get(eval_every_param)
        return evaluate_body(run_url, int(every or Run.open(run_url).config.eval.every))

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

    @task(task_id="report")
    def report(run_url: str) -> str:
        """report/report.md and report/curves.png of the run."""
        return report_body(run_url, keep_existing=keep_report)

    trained = train(run_url)
    ids >> trained
    workers = rollout_worker.partial(run_url=run_url).expand(worker_id=ids)
    evaluated = evaluate(orm(trained))
    workers >> evaluated
    return report(evaluated)
