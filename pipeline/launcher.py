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


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
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
