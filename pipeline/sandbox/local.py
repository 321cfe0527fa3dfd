"""The local backend: runs go to this process's pool of bubblewrap workers (`pool.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from pipeline.sandbox.limits import Limits
from pipeline.sandbox.pool import pool_for
from pipeline.sandbox.result import ExecResult, Job


class LocalSandbox:
    """Runs each program in a worker of this process's pool (one pool per set of mounts)."""

    def execute(self, code: str, *, stdin: str = "", limits: Limits | None = None) -> ExecResult:
        """Run `code` with `stdin` under `limits` (default `Limits()`)."""
        limits = limits or Limits()
        return pool_for(limits).execute(code, stdin, limits)

    def execute_many(
        self, jobs: Sequence[Job], *, concurrency: int | None = None
    ) -> list[ExecResult]:
        """Every job's result, in the jobs' order, up to `concurrency` at once (default:
        the pool's size, one worker per CPU)."""
        if not jobs:
            return []

        def one(job: Job) -> ExecResult:
            return self.execute(job.code, stdin=job.stdin, limits=job.limits)

        width = concurrency or pool_for(jobs[0].limits or Limits()).size
        if width <= 1 or len(jobs) == 1:
            return [one(job) for job in jobs]
        with ThreadPoolExecutor(max_workers=min(width, len(jobs))) as threads:
            return list(threads.map(one, jobs))
