"""`rlax sandbox serve`: the sandbox as an HTTP service, for graders on many machines.

    POST /run_code   one program (the body and reply of `pipeline/sandbox/api.py`,
                     SandboxFusion's shape)
    GET  /health     liveness, and the service's counters (runs in flight and waiting,
                     served, refused for a full queue), for load balancers and tests

Runs go to this process's own pool of bubblewrap workers (`pipeline.sandbox.pool`), from
a thread pool of `concurrency` threads, so a run through the service has every guarantee
of a local `execute` (docs/security.md). At most `concurrency` runs are in flight and
`queue` more wait; a request beyond that is answered 429 with Retry-After at once, so a
full replica sheds load (the client retries it, on another replica behind a load
balancer) instead of holding connections open without bound. With a token, every
request but `/health` must carry `Authorization: Bearer <token>` (401 otherwise), checked
before a byte of its body is read. Body size, head and body deadlines and the number of
connections are bounded (`pipeline.ops.http_guard`), and so is every limit a client
may ask for (`MAX_LIMITS`, `--max-limit`): a request beyond is 400, naming the field, its
value and the maximum. Stateless: replicas need nothing from each other (docs/sandbox.md).
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import threading
import time
import typing
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, create_model

from pipeline.errors import ConfigError, check
from pipeline.ops.http_guard import (
    MAX_HEADER_BYTES,
    ASGIApp,
    ConnectionGuard,
    HttpLimits,
    RequestGuard,
    guarded_protocol,
)
from pipeline.sandbox import api
from pipeline.sandbox.limits import MIB, Limits
from pipeline.sandbox.pool import close_all, pool_for
from pipeline.sandbox.result import ExecResult, SandboxError

# Seconds a refused client should wait: a run of the default limits takes milliseconds to
# seconds, so a slot is likely free by then; HTTP allows whole seconds only.
RETRY_AFTER_S = 1
# How long a stopping service lets runs in flight finish before it kills the workers.
SHUTDOWN_GRACE_S = 5
# Distinct worker kinds (`Limits.worker_key`: packages, warm-up, mounts, /tmp size) kept at
# once: each is a pool of `concurrency` workers, so without a bound a client sending a new
# warm-up per request would start processes without end.
MAX_WORKER_KINDS = 8
# The most a request may ask for of each numeric `Limits` field (`--max-limit FIELD=N`
# changes one). A run past what the host allows would fail every time without a word
# (RLIMIT_NPROC or RLIMIT_NOFILE above the service's own hard limit: the worker cannot set
# it), and a long or large run holds a slot and memory other clients need.
MAX_LIMITS: dict[str, float] = {
    "timeout_s": 60.0,
    "cpu_s": 60.0,
    "memory_mb": 4096,
    "processes": 256,
    "file_size_mb": 256,
    "tmpfs_mb": 1024,
    "output_bytes": 16 * MIB,
    "open_files": 4096,
}
# Fields the kernel bounds by the service's own hard rlimit, which a sandbox cannot raise.
HOST_RLIMITS = {"processes": "RLIMIT_NPROC", "open_files": "RLIMIT_NOFILE"}
TOKEN_HELP = (
    "the token it was started with (RLAX_SANDBOX_TOKEN, or the variable named by sandbox.token_env)"
)


def max_limits(given: Mapping[str, float] | None = None) -> dict[str, float]:
    """`MAX_LIMITS` with `given` on top, each checked: a `MAX_LIMITS` field, no lower than
    `Limits`' default (or default requests would be refused) and, for `HOST_RLIMITS`, no
    higher than this process's hard rlimit (a default above it is lowered to it)."""
    maxima = dict(MAX_LIMITS)
    default = Limits()
    for name, value in (given or {}).items():
        check(name in MAX_LIMITS, "--max-limit", name, f"one of {', '.join(MAX_LIMITS)}")
        floor = getattr(default, name) or 0
        check(value >= floor and value > 0, f"--max-limit {name}", value, f">= {floor}, > 0")
        maxima[name] = value
    for name, rlimit in HOST_RLIMITS.items():
        hard = resource.getrlimit(getattr(resource, rlimit))[1]
        if hard == resource.RLIM_INFINITY or maxima[name] <= hard:
            continue
        check(
            name not in (given or {}),
            f"--max-limit {name}",
            maxima[name],
            f"<= {hard}, this host's hard {rlimit} (a run cannot raise it)",
        )
        maxima[name] = hard
    return maxima


def _wire_type(tp: Any) -> Any:
    """A `Limits` field's type as JSON carries it: a tuple is a list (strict validation of
    the parsed body takes no list for a tuple), anything may be null (the default)."""
    if typing.get_origin(tp) is tuple:
        tp = list[typing.get_args(tp)[0]]
    return tp | None


# `rlax_limits`: the `Limits` fields SandboxFusion has no name for, typed from `Limits`
# itself, so a field added there travels without being listed here too.
ExtraLimits = create_model(
    "ExtraLimits",
    __config__=ConfigDict(extra="forbid", strict=True),
    **{
        name: (_wire_type(typing.get_type_hints(Limits)[name]), None)
        for name in api.EXTRA_LIMIT_FIELDS
    },
)


class RunCodeRequest(BaseModel):
    """The body of `POST /run_code` (SandboxFusion's field names)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    code: str
    language: str = "python"
    stdin: str = ""
    run_timeout: float | None = None
    memory_limit_MB: int | None = None  # noqa: N815 (SandboxFusion's spelling)
    compile_timeout: float | None = None  # accepted for SandboxFusion clients: nothing compiles
    files: dict[str, str] = {}
    fetch_files: list[str] = []
    rlax_limits: ExtraLimits | None = None  # type: ignore[valid-type]


@dataclass
class Counters:
    """What `/health` reports. `admitted` (running or waiting for a thread) and the totals
    change only on the event loop's thread; `running` on the run threads, under a lock."""

    admitted: int = 0
    running: int = 0
    served: int = 0
    refused_full: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


class SandboxService:
    """Admission (at most `concurrency` runs plus `queue` waiting) in front of the pool."""

    def __init__(
        self,
        *,
        token: str | None = None,
        concurrency: int | None = None,
        queue: int | None = None,
        ro_paths: tuple[str, ...] = (),
        max_worker_kinds: int = MAX_WORKER_KINDS,
        limit_maxima: Mapping[str, float] | None = None,
        http: HttpLimits | None = None,
    ) -> None:
        self.token = token or None
        self.maxima = max_limits(limit_maxima)
        self.guard = ConnectionGuard(http or HttpLimits())
        self.concurrency = concurrency or os.cpu_count() or 1
        self.queue = self.concurrency if queue is None else queue
        if self.concurrency < 1 or self.queue < 0 or max_worker_kinds < 1:
            raise ConfigError(
                f"concurrency={self.concurrency}, queue={self.queue}, max_worker_kinds="
                f"{max_worker_kinds} are invalid; allowed: concurrency >= 1, queue >= 0 and "
                "max_worker_kinds >= 1"
            )
        self.max_worker_kinds = max_worker_kinds
        # The worker kinds that have served a run (only the event loop's thread touches
        # it); a kind whose workers never start (a missing package) takes no place.
        self._kinds: set[tuple] = {Limits().worker_key()}
        self.ro_paths = tuple(ro_paths)
        Limits(extra_ro_paths=self.ro_paths)  # each must exist: fail at start, not per run
        self.counters = Counters()
        self.host = socket.gethostname()
        self._running_lock = threading.Lock()
        self._threads = ThreadPoolExecutor(self.concurrency, thread_name_prefix="sandbox-run")

    def warm(self) -> None:
        """Start the default pool's workers now: a host that cannot run a sandbox fails
        here, with bubblewrap's reason, instead of on the first request."""
        pool_for(Limits(), self.concurrency).warm()

    def _run(self, code: str, stdin: str, limits: Limits) -> ExecResult:
        # On one of the thread pool's threads. The pool of `limits`' mounts is sized like
        # the admission (its first use creates it).
        with self._running_lock:
            self.counters.running += 1
        try:
            return pool_for(limits, self.concurrency).execute(code, stdin, limits)
        finally:
            with self._running_lock:
                self.counters.running -= 1

    def check_kind(self, limits: Limits) -> None:
        """ConfigError when `limits` needs a new kind of worker and the service already
        keeps `max_worker_kinds` of them."""
        if limits.worker_key() in self._kinds or len(self._kinds) < self.max_worker_kinds:
            return
        raise ConfigError(
            f"{api.EXTRA_LIMITS}: this service already keeps {len(self._kinds)} kinds of "
            "workers (distinct packages, warmup, tmpfs_mb, extra_ro_paths), its "
            "--max-worker-kinds; allowed: the values of those runs, or a service started "
            "with a larger --max-worker-kinds"
        )

    async def run(self, code: str, stdin: str, limits: Limits) -> ExecResult | None:
        """The run's result, or None when the service is full (refuse with 429). Raises
        SandboxError when no worker of `limits`' kind can start."""
        c = self.counters
        if c.admitted >= self.concurrency + self.queue:
            c.refused_full += 1
            return None
        c.admitted += 1
        try:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self._threads, self._run, code, stdin, limits)
        finally:
            c.admitted -= 1
        self._kinds.add(limits.worker_key())
        c.served += 1
        c.by_status[result.status] = c.by_status.get(result.status, 0) + 1
        return result

    def health(self) -> dict[str, Any]:
        c = self.counters
        return {
            "status": "ok",
            "host": self.host,
            "concurrency": self.concurrency,
            "queue": self.queue,
            "running": c.running,
            "waiting": max(c.admitted - c.running, 0),
            "served": c.served,
            "refused_full": c.refused_full,
            "worker_kinds": len(self._kinds),
            "by_status": dict(c.by_status),
            **self.guard.health(),
            "pid": os.getpid(),
        }

    def close(self) -> None:
        """Stop taking runs and kill every worker (runs in flight end as errors)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        close_all()


def _describe(errors: list[dict[str, Any]]) -> str:
    """One line per invalid part of a request: the field, what was wrong, what is allowed."""
    allowed = ", ".join(RunCodeRequest.model_fields)
    lines = []
    for error in errors:
        loc = ".".join(str(part) for part in error["loc"][1:])  # [0] is "body"
        if error["type"] == "json_invalid":
            lines.append(f"the body is not valid JSON: {error.get('ctx', {}).get('error', '')}")
        elif error["type"] == "extra_forbidden":
            inner = loc.startswith(api.EXTRA_LIMITS + ".")
            names = ", ".join(api.EXTRA_LIMIT_FIELDS) if inner else allowed
            lines.append(f"unknown field {loc!r}; allowed: {names}")
        elif not loc:
            lines.append(
                f"the body must be a JSON object (Content-Type: application/json) with the "
                f"fields {allowed}"
            )
        else:
            lines.append(f"{loc}={error.get('input')!r} is invalid: {error['msg']}")
    return "; ".join(lines)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def create_app(service: SandboxService) -> ASGIApp:
    """The ASGI application serving `service`, behind its `RequestGuard` (the token and
    the body are checked there, before FastAPI reads anything)."""
    app = FastAPI(title="rlax sandbox", description=__doc__, docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _describe(list(exc.errors())))

    @app.post(api.RUN_PATH)
    async def run_code(body: RunCodeRequest) -> JSONResponse:
        if body.language not in api.LANGUAGES:
            return _error(400, f"language={body.language!r} is not supported; allowed: 'python'")
        if body.files or body.fetch_files:
            return _error(400, "files and fetch_files are not supported; allowed: {} and []")
        named = {wire: getattr(body, wire) for wire in api.NAMED_LIMITS}
        extra = body.rlax_limits.model_dump(exclude_none=True) if body.rlax_limits else None
        try:
            limits = api.limits_from_request(named, extra, service.ro_paths, service.maxima)
            service.check_kind(limits)
        except ConfigError as err:
            return _error(400, str(err))
        try:
            result = await service.run(body.code, body.stdin, limits)
        except SandboxError as err:
            reply = {"status": "SandboxError", "message": str(err), "run_result": None}
            return JSONResponse(reply, status_code=500)
        if result is None:
            return _error(
                429,
                f"the service is full ({service.concurrency} runs in flight, "
                f"{service.queue} waiting): retry after {RETRY_AFTER_S} s",
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        return JSONResponse(api.reply_from_result(result, service.host))

    @app.get(api.HEALTH_PATH)
    async def health() -> dict[str, Any]:
        return service.health()

    return RequestGuard(
        app,
        service.guard,
        token=service.token,
        token_help=TOKEN_HELP,
        open_paths=(api.HEALTH_PATH,),
    )


def serve(
    host: str,
    port: int,
    *,
    token: str | None = None,
    concurrency: int | None = None,
    queue: int | None = None,
    ro_paths: tuple[str, ...] = (),
    max_worker_kinds: int = MAX_WORKER_KINDS,
    limit_maxima: Mapping[str, float] | None = None,
    http: HttpLimits | None = None,
    log: Callable[[str], None] = print,
) -> None:
    """Serve until SIGINT or SIGTERM, then kill every sandbox worker. Prints the URL once
    it accepts connections (`port` 0: a free one)."""
    import uvicorn

    service = SandboxService(
        token=token,
        concurrency=concurrency,
        queue=queue,
        ro_paths=ro_paths,
        max_worker_kinds=max_worker_kinds,
        limit_maxima=limit_maxima,
        http=http,
    )
    # uvicorn ends by re-raising the SIGTERM it caught, and SIGTERM's default action would
    # end the process before the `finally` below kills the workers: as an exception, the
    # cleanup runs (SIGINT already arrives as KeyboardInterrupt).
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    started = time.monotonic()
    try:
        service.warm()
        # Bound and listening before the URL is printed, so a client that reads it and
        # connects at once is queued by the kernel rather than refused.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=1024)
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        url = f"http://{shown}:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            create_app(service),
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            # h11 (not httptools): its head-size bound, and the protocol the guard extends.
            http=guarded_protocol(service.guard),
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            timeout_keep_alive=service.guard.limits.idle_timeout_s,  # type: ignore[arg-type]
        )
        log(
            f"rlax sandbox: serving {url} ({service.concurrency} runs at once, "
            f"{service.queue} waiting, token {'required' if service.token else 'NOT required'})"
        )
        with sock:
            uvicorn.Server(config).run(sockets=[sock])
    except _Stopped:
        pass  # SIGTERM: a normal stop
    finally:
        signal.signal(signal.SIGTERM, previous)
        service.close()
        log(
            f"rlax sandbox: stopped after {time.monotonic() - started:.0f} s, "
            f"{service.counters.served} runs served, its sandbox workers killed"
        )


class _Stopped(Exception):
    """SIGTERM, as an exception (see `serve`)."""


def _raise_stopped(_signum: int, _frame: object) -> None:
    raise _Stopped
