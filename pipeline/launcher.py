"""The one place that turns a role into a command line and starts it as a process.

`rlax`, the demo and the Airflow DAGs all start jobs through here, so a laptop run and
a cluster run differ only in where the very same command lands (a local process here;
a Kubernetes pod, a TPU VM or a Dataflow job at scale).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# role -> python module with a `main(argv)` entry point
JOBS: dict[str, str] = {
    "sft": "tpu_jobs.sft",
    "train": "tpu_jobs.trainer",
    "rollout": "tpu_jobs.rollout_worker",
    "eval": "tpu_jobs.evaluator",
    "pass-rates": "tpu_jobs.pass_rates",
    "orm": "tpu_jobs.orm",
}


def job_command(role: str, run_url: str, extra: Sequence[str] = ()) -> list[str]:
    if role not in JOBS:
        raise ValueError(f"unknown job role {role!r}; allowed: {', '.join(JOBS)}")
    return [sys.executable, "-m", JOBS[role], "--run", run_url, *extra]


# JAX's persistent compilation cache, shared by every job of this machine: a worker or
# trainer restarted after preemption, the evaluator after the workers (the same sampler
# programs) and the next run of the same config load compiled programs instead of
# compiling them again. XLA keys entries by program, compiler version and flags, so a
# hit runs the very program a fresh compile would have built. RLAX_COMPILE_CACHE picks
# the directory ("off" disables it); JAX_COMPILATION_CACHE_DIR, if set, wins.
COMPILE_CACHE_ENV = "RLAX_COMPILE_CACHE"
DEFAULT_COMPILE_CACHE = Path.home() / ".cache" / "rlax" / "jax-compile"
# Cache programs that took at least this long to compile (JAX's default, 1 s, skips most
# of the sampler's and trainer's CPU programs, each 0.1-1 s, and there are dozens).
COMPILE_CACHE_MIN_SECONDS = "0.1"


def compile_cache_env(environ: dict[str, str]) -> dict[str, str]:
    """The JAX_* variables that turn on the persistent compilation cache for a job."""
    where = environ.get(COMPILE_CACHE_ENV, str(DEFAULT_COMPILE_CACHE))
    if where.lower() == "off" or "JAX_COMPILATION_CACHE_DIR" in environ:
        return {}
    return {
        "JAX_COMPILATION_CACHE_DIR": where,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": environ.get(
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", COMPILE_CACHE_MIN_SECONDS
        ),
    }


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(compile_cache_env(env))
    return env


def start(
    role: str,
    run_url: str,
    extra: Sequence[str] = (),
    *,
    log_path: Path | None = None,
) -> subprocess.Popen:
    """Start a job; its output goes to `log_path` (or is inherited when None)."""
    cmd = job_command(role, run_url, extra)
    out = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    return subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        env=job_env(),
        start_new_session=True,
    )


def run_job(role: str, run_url: str, extra: Sequence[str] = ()) -> int:
    """Run a job in the foreground with inherited output; return its exit code."""
    return subprocess.call(job_command(role, run_url, extra), env=job_env())
