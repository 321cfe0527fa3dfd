"""`pipeline.sandbox`: untrusted code (model output) runs here and nowhere else.

    result = execute(program, stdin="1 2\\n", timeout_s=5, memory_mb=256)
    result.status  # "ok", "error", "timeout", "memory" or "output_limit"

Each run is a fork of a pre-started worker inside a bubblewrap sandbox (Linux user, mount,
PID, network, IPC and UTS namespaces; rlimits per run); what that guarantees and how is in
`pipeline/sandbox/isolation.py`, `pipeline/sandbox/worker.py` and docs/security.md.
Importing this package starts nothing: the first `execute` starts the workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pipeline.sandbox.isolation import IsolationUnavailable
from pipeline.sandbox.limits import Limits
from pipeline.sandbox.pool import pool_for
from pipeline.sandbox.result import STATUSES, ExecResult, SandboxError

__all__ = [
    "STATUSES",
    "ExecResult",
    "IsolationUnavailable",
    "Limits",
    "SandboxError",
    "Job",
    "execute",
    "execute_many",
]


def execute(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float | None = None,
    memory_mb: int | None = None,
    limits: Limits | None = None,
) -> ExecResult:
    """Run the Python program `code` in the sandbox with `stdin` as its standard input.

    `timeout_s` and `memory_mb` override those fields of `limits` (default `Limits()`).
    Raises SandboxError only when the sandbox itself cannot run; everything the program
    does is reported in the result's status. Safe to call from several threads.
    """
    limits = limits or Limits()
    overrides = {"timeout_s": timeout_s, "memory_mb": memory_mb}
    limits = dataclasses.replace(limits, **{k: v for k, v in overrides.items() if v is not None})
    return pool_for(limits).execute(code, stdin, limits)


@dataclass(frozen=True)
class Job:
    """One program to run: its text, standard input and limits (None: `Limits()`)."""

    code: str
    stdin: str = ""
    limits: Limits | None = None


def execute_many(jobs: Sequence[Job], *, concurrency: int | None = None) -> list[ExecResult]:
    """Run every job, up to `concurrency` at once (default: the pool's size, one per CPU),
    and return their results in the jobs' order. Verifiers score a whole batch of
    completions with one call, so the runs overlap instead of waiting on each other."""
    if not jobs:
        return []

    def one(job: Job) -> ExecResult:
        limits = job.limits or Limits()
        return pool_for(limits).execute(job.code, job.stdin, limits)

    width = concurrency or pool_for(jobs[0].limits or Limits()).size
    if width <= 1 or len(jobs) == 1:
        return [one(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=min(width, len(jobs))) as threads:
        return list(threads.map(one, jobs))
