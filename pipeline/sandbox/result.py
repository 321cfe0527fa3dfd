"""What a sandboxed run is given (`Job`) and returns (`ExecResult`), and the error raised when
no sandbox can run at all."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.sandbox.limits import Limits

# "ok": exit 0; "error": any other exit, or killed by a signal; "timeout": the wall clock
# or the CPU limit; "memory": an allocation past `memory_mb` (MemoryError);
# "output_limit": stdout and stderr together passed the cap and the run was killed.
STATUSES = ("ok", "error", "timeout", "memory", "output_limit")


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (no user namespaces, bwrap missing, a worker that
    does not start); a program's own failure is an `ExecResult` status instead."""


@dataclass(frozen=True)
class ExecResult:
    """One run: `status` (one of STATUSES), the exit code (negative: killed by that
    signal), what it printed (decoded as UTF-8, undecodable bytes replaced, cut at the
    output cap) and its wall-clock seconds inside the sandbox."""

    status: str
    returncode: int
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Job:
    """One program to run: its text, standard input and limits (None: `Limits()`)."""

    code: str
    stdin: str = ""
    limits: Limits | None = None
