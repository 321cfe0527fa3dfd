"""`pipeline.sandbox`: untrusted code (model output) runs here and nowhere else.

    result = execute(program, stdin="1 2\\n", timeout_s=5, memory_mb=256)
    result.status  # "ok", "error", "timeout", "memory" or "output_limit"

Each run is a fork of a pre-started worker inside a bubblewrap sandbox (Linux user, mount,
PID, network, IPC and UTS namespaces; rlimits per run); what that guarantees and how is in
`pipeline/sandbox/isolation.py`, `pipeline/sandbox/worker.py` and docs/security.md.
Importing this package starts nothing: the first `execute` starts the workers.

Where runs go is the process's backend, picked by URL scheme from `BACKENDS`: this
process's own pool (no URL, the default) or a sandbox service (`rlax sandbox serve`,
`http(s)://host:port`, docs/sandbox.md). `configure(url, token)` sets it; a process that
never calls it takes RLAX_SANDBOX_URL and RLAX_SANDBOX_TOKEN from its environment.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from typing import Protocol
from urllib.parse import urlsplit

from pipeline.errors import ConfigError
from pipeline.sandbox.isolation import IsolationUnavailable
from pipeline.sandbox.limits import Limits
from pipeline.sandbox.result import STATUSES, ExecResult, Job, SandboxError

__all__ = [
    "BACKENDS",
    "STATUSES",
    "ExecResult",
    "IsolationUnavailable",
    "Limits",
    "SandboxError",
    "Job",
    "configure",
    "execute",
    "execute_many",
]

URL_ENV = "RLAX_SANDBOX_URL"
TOKEN_ENV = "RLAX_SANDBOX_TOKEN"


class Backend(Protocol):
    """Where runs go: `LocalSandbox` (pipeline/sandbox/local.py) or `RemoteSandbox`
    (pipeline/sandbox/client.py)."""

    def execute(
        self, code: str, *, stdin: str = "", limits: Limits | None = None
    ) -> ExecResult: ...

    def execute_many(
        self, jobs: Sequence[Job], *, concurrency: int | None = None
    ) -> list[ExecResult]: ...


def _local(url: str, token: str | None, concurrency: int | None) -> Backend:
    from pipeline.sandbox.local import LocalSandbox

    return LocalSandbox()


def _remote(url: str, token: str | None, concurrency: int | None) -> Backend:
    # Imported on use: only a process that talks to a service needs the HTTP client.
    from pipeline.sandbox.client import RemoteSandbox

    return RemoteSandbox(url, token, concurrency=concurrency or 0)


# Backends by URL scheme ("" = no URL). A new kind of backend registers here and nowhere else.
BACKENDS: dict[str, Callable[[str, str | None, int | None], Backend]] = {
    "": _local,
    "http": _remote,
    "https": _remote,
}

_backend: Backend | None = None
_backend_lock = threading.Lock()


def _make(url: str | None, token: str | None, concurrency: int | None) -> Backend:
    url = url or ""
    scheme = urlsplit(url).scheme
    if scheme not in BACKENDS:
        raise ConfigError(
            f"sandbox url {url!r} is invalid; allowed: empty (the local pool) or a URL of "
            f"scheme {', '.join(repr(s) for s in BACKENDS if s)}"
        )
    return BACKENDS[scheme](url, token or None, concurrency)


def configure(url: str | None, token: str | None = None, concurrency: int | None = None) -> None:
    """Send this process's runs to the service at `url` (with `token`), or to the local
    pool when `url` is empty or None. `concurrency`: `execute_many`'s default width on a
    service (None: the service's own concurrency + queue). Call it before runs start: the
    previous backend's connections are closed."""
    global _backend
    new = _make(url, token, concurrency)
    with _backend_lock:
        old, _backend = _backend, new
    if old is not None and hasattr(old, "close"):
        old.close()


def backend() -> Backend:
    """The process's backend: as `configure` set it, else from RLAX_SANDBOX_URL and
    RLAX_SANDBOX_TOKEN (the local pool when the URL is unset or empty)."""
    global _backend
    if _backend is None:
        with _backend_lock:
            if _backend is None:
                _backend = _make(os.environ.get(URL_ENV), os.environ.get(TOKEN_ENV), None)
    return _backend


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
    return backend().execute(code, stdin=stdin, limits=limits)


def execute_many(jobs: Sequence[Job], *, concurrency: int | None = None) -> list[ExecResult]:
    """Run every job, up to `concurrency` at once (default: the pool's size, one per CPU,
    or the service's width), and return their results in the jobs' order. Verifiers score
    a whole batch of completions with one call, so the runs overlap instead of waiting on
    each other."""
    return backend().execute_many(jobs, concurrency=concurrency)
