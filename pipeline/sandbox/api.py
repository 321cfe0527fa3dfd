"""The HTTP protocol of the sandbox service, the one definition `service.py` and `client.py`
both speak (no web framework here: a client imports only this and its HTTP library).

In the shape of SandboxFusion's `POST /run_code` (bytedance/SandboxFusion), so its clients
work unchanged for Python:

    request  {"code": str, "language": "python", "stdin": str,
              "run_timeout": seconds, "memory_limit_MB": MiB,   # optional, null: defaults
              "compile_timeout": ignored (nothing compiles), "files": {}, "fetch_files": [],
              "rlax_limits": {Limits field: value}}              # optional, ours
    reply    {"status": "Success" | "Failed" | "SandboxError", "message": str,
              "compile_result": null, "files": {}, "executor_pod_name": host name,
              "run_result": {"status": one of STATUSES, "return_code": int,
                             "stdout": str, "stderr": str, "execution_time": seconds}}

Where this differs from SandboxFusion: `run_result.status` is `pipeline.sandbox`'s status
("ok", "error", "timeout", "memory", "output_limit"), finer than its
"Finished"/"Error"/"TimeLimitExceeded"; `memory_limit_MB` -1 (its "no limit") means the
service's default, since no run here is unlimited; `rlax_limits` carries the `Limits` fields
SandboxFusion has no name for. "Success" means the program exited 0, "Failed" anything else
it did; "SandboxError" (HTTP 500) that no sandbox could run it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pipeline.errors import ConfigError, check
from pipeline.sandbox.limits import Limits
from pipeline.sandbox.result import ExecResult

RUN_PATH = "/run_code"
HEALTH_PATH = "/health"
LANGUAGES = ("python",)
# SandboxFusion's request fields that are `Limits` fields, by their name there.
NAMED_LIMITS = {"run_timeout": "timeout_s", "memory_limit_MB": "memory_mb"}
# SandboxFusion's "no memory limit": here the service's default.
NO_MEMORY_LIMIT = -1
EXTRA_LIMITS = "rlax_limits"
# The `Limits` fields that travel in `rlax_limits`: every one SandboxFusion does not name.
EXTRA_LIMIT_FIELDS = tuple(
    f.name for f in dataclasses.fields(Limits) if f.name not in NAMED_LIMITS.values()
)
URL_ALLOWED = "http://host:port or https://host[:port], nothing after it (empty: the local pool)"


def check_url(name: str, url: str) -> str:
    """`url` without a trailing slash, or ConfigError naming `name` and what is allowed."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        parts, port = None, None
    check(
        parts is not None
        and parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and (port is not None or parts.scheme == "https")
        and parts.path in ("", "/")
        and not (parts.query or parts.fragment or parts.username or parts.password),
        name,
        url,
        URL_ALLOWED,
    )
    return url.rstrip("/")


def request_body(code: str, stdin: str, limits: Limits) -> dict[str, Any]:
    """The JSON body of one run: the named limits always, the others when not default."""
    default = Limits()
    extra = {
        name: list(value) if isinstance(value, tuple) else value
        for name in EXTRA_LIMIT_FIELDS
        if (value := getattr(limits, name)) != getattr(default, name)
    }
    body: dict[str, Any] = {"code": code, "language": "python", "stdin": stdin}
    body |= {wire: getattr(limits, field) for wire, field in NAMED_LIMITS.items()}
    if extra:
        body[EXTRA_LIMITS] = extra
    return body


def limits_from_request(
    named: Mapping[str, Any],
    extra: Mapping[str, Any] | None,
    allowed_ro_paths: tuple[str, ...],
    maxima: Mapping[str, float],
) -> Limits:
    """The `Limits` of a request: `named` holds its SandboxFusion fields (None: the
    default), `extra` its `rlax_limits`. Raises ConfigError naming the request field,
    with `Limits`' own check of the value, or its value and the service's maximum when
    above `maxima` (by `Limits` field); `extra_ro_paths` must be among the paths the
    service was started with, since a client must not choose which host files a
    sandbox sees."""
    values: dict[str, Any] = {}
    for wire, field in NAMED_LIMITS.items():
        value = named.get(wire)
        if value is None or (wire == "memory_limit_MB" and value == NO_MEMORY_LIMIT):
            continue
        values[wire] = (field, value)
    for field, value in (extra or {}).items():
        check(field in EXTRA_LIMIT_FIELDS, EXTRA_LIMITS, field, f"one of {EXTRA_LIMIT_FIELDS}")
        if value is None:
            continue
        if isinstance(value, list):  # JSON has no tuples
            value = tuple(value)
        if field == "extra_ro_paths":
            check(
                all(path in allowed_ro_paths for path in value),
                f"{EXTRA_LIMITS}.extra_ro_paths",
                list(value),
                f"paths the service was started with (--ro-path): {list(allowed_ro_paths)}",
            )
        values[f"{EXTRA_LIMITS}.{field}"] = (field, value)
    # One field at a time first, so the error names the request's field, not only the
    # `Limits` one (no check of `Limits` spans two fields).
    for wire, (field, value) in values.items():
        try:
            Limits(**{field: value})
        except ConfigError as err:
            raise ConfigError(f"{wire}: {err}") from None
        except TypeError:
            raise ConfigError(f"{wire}={value!r} is invalid; allowed: a number") from None
        if field in maxima and value > maxima[field]:
            raise ConfigError(
                f"{wire}={value!r} is above this service's maximum; allowed: at most "
                f"{maxima[field]:g} (a service started with a larger --max-limit {field}=N)"
            )
    return Limits(**{field: value for field, value in values.values()})


def reply_from_result(result: ExecResult, host: str) -> dict[str, Any]:
    """The reply to a run that the sandbox ran."""
    return {
        "status": "Success" if result.ok else "Failed",
        "message": "",
        "compile_result": None,
        "run_result": {
            "status": result.status,
            "return_code": result.returncode,
            "stdout": result.stdout,
            "stderr": result.stderr,
            "execution_time": result.wall_s,
        },
        "executor_pod_name": host,
        "files": {},
    }


def result_from_reply(reply: Mapping[str, Any]) -> ExecResult:
    """The ExecResult a reply carries (KeyError/TypeError when it carries none)."""
    run = reply["run_result"]
    return ExecResult(
        status=run["status"],
        returncode=int(run["return_code"]),
        stdout=run["stdout"],
        stderr=run["stderr"],
        wall_s=float(run["execution_time"]),
    )
