"""`RemoteSandbox`: `execute` and `execute_many` through a sandbox service over HTTP.

    sandbox = RemoteSandbox("http://127.0.0.1:8080", token=os.environ["RLAX_SANDBOX_TOKEN"])
    sandbox.execute("print(input())", stdin="hi\\n").stdout  # "hi\\n"

A job is never lost: a 429 (the service is full) is retried after its Retry-After, and a
refused or reset connection, a timeout or a load balancer's 502/503/504 after a growing
backoff. A run has no effect outside its sandbox, so running it again is harmless. What
cannot succeed by retrying (no service at the URL after `retries` tries, a refused token,
a request the service does not understand, a service whose sandbox cannot start) raises
`SandboxError`, naming the URL and what to do.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx

from pipeline.sandbox import api
from pipeline.sandbox.limits import Limits
from pipeline.sandbox.result import ExecResult, Job, SandboxError

# Statuses a load balancer or a restarting replica answers with: worth another try.
TRANSIENT_STATUSES = (502, 503, 504)


class RemoteSandbox:
    """A client of `rlax sandbox serve` at `url`.

    timeout_s: how long a request may wait for its reply beyond the run's own time limit
        (queueing on the service, the network).
    retries: tries after the first for a refused or reset connection, a timeout or a 5xx
        of a proxy, with a backoff of 0.2 s doubling up to 5 s.
    max_wait_s: how long one job keeps retrying 429s of a full service before giving up.
    concurrency: `execute_many`'s width when the caller gives none (0: ask the service
        for its `concurrency` + `queue`, once).
    Safe to use from several threads (one connection pool, shared).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 60.0,
        retries: int = 3,
        max_wait_s: float = 600.0,
        concurrency: int = 0,
    ) -> None:
        self.url = api.check_url("sandbox url", url)
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_wait_s = max_wait_s
        self.concurrency = concurrency
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    def _unreachable(self, why: str) -> SandboxError:
        port = urlsplit(self.url).port or "N"
        return SandboxError(
            f"the sandbox service at {self.url} does not answer ({why}) after "
            f"{self.retries + 1} tries; start one with `rlax sandbox serve --host 127.0.0.1 "
            f"--port {port}` or point RLAX_SANDBOX_URL (sandbox.url) at a running one"
        )

    def _post(self, body: dict[str, Any], run_timeout_s: float) -> httpx.Response:
        """The service's answer to `body` other than 429 or a transient failure."""
        failures = 0
        waited = 0.0
        timeout = httpx.Timeout(run_timeout_s + self.timeout_s, connect=10.0)
        while True:
            try:
                response = self._http.post(api.RUN_PATH, json=body, timeout=timeout)
            except httpx.TransportError as err:  # refused, reset, timed out
                why = f"{type(err).__name__}: {err}"
                response = None
            if response is not None and response.status_code == 429:
                if waited >= self.max_wait_s:
                    raise SandboxError(
                        f"the sandbox service at {self.url} stayed full for {waited:.0f} s "
                        "(429): add replicas or lower the callers' concurrency"
                    )
                # Jitter, so the callers a full service refused together do not all come
                # back in the same instant.
                delay = _retry_after(response) * random.uniform(1.0, 1.25)
                time.sleep(delay)
                waited += delay
                continue
            if response is not None and response.status_code not in TRANSIENT_STATUSES:
                return response
            if response is not None:
                why = f"HTTP {response.status_code}"
            failures += 1
            if failures > self.retries:
                raise self._unreachable(why)
            time.sleep(min(0.2 * 2 ** (failures - 1), 5.0) * random.uniform(0.5, 1.0))

    def execute(self, code: str, *, stdin: str = "", limits: Limits | None = None) -> ExecResult:
        """Run `code` with `stdin` under `limits` (default `Limits()`) on the service."""
        limits = limits or Limits()
        response = self._post(api.request_body(code, stdin, limits), limits.timeout_s)
        try:
            reply = response.json()
        except ValueError:
            reply = None
        if response.status_code == 200 and isinstance(reply, dict):
            # A reply not in the protocol's shape falls through to the error at the end.
            with contextlib.suppress(KeyError, TypeError, ValueError):
                return api.result_from_reply(reply)
        if response.status_code in (401, 403):
            given = "no token was sent" if response.status_code == 401 else "the token is wrong"
            raise SandboxError(
                f"the sandbox service at {self.url} refused the request "
                f"(HTTP {response.status_code}: {given}); set RLAX_SANDBOX_TOKEN (or the "
                "variable sandbox.token_env names) to the token the service was started with"
            )
        if isinstance(reply, dict) and reply.get("status") == "SandboxError":
            # The service's sandbox could not run it (a package it lacks, bwrap refused):
            # its reason, not a failure of the program.
            raise SandboxError(
                f"the sandbox service at {self.url} could not run the program: "
                f"{reply.get('message')}"
            )
        detail = (reply.get("detail") or reply.get("message")) if isinstance(reply, dict) else None
        raise SandboxError(
            f"the sandbox service at {self.url} answered HTTP {response.status_code}: "
            f"{detail or response.text[:500]}"
        )

    def health(self) -> dict[str, Any]:
        """The service's `/health` reply (its counters)."""
        try:
            response = self._http.get(api.HEALTH_PATH, timeout=10.0)
        except httpx.TransportError as err:
            raise self._unreachable(f"{type(err).__name__}: {err}") from None
        response.raise_for_status()
        return response.json()

    def execute_many(
        self, jobs: Sequence[Job], *, concurrency: int | None = None
    ) -> list[ExecResult]:
        """Every job's result, in the jobs' order, up to `concurrency` requests at once."""
        if not jobs:
            return []
        width = concurrency or self.concurrency
        if not width:
            health = self.health()
            width = self.concurrency = int(health["concurrency"]) + int(health["queue"])

        def one(job: Job) -> ExecResult:
            return self.execute(job.code, stdin=job.stdin, limits=job.limits)

        if width <= 1 or len(jobs) == 1:
            return [one(job) for job in jobs]
        with ThreadPoolExecutor(max_workers=min(width, len(jobs))) as threads:
            return list(threads.map(one, jobs))

    def close(self) -> None:
        self._http.close()


def _retry_after(response: httpx.Response) -> float:
    """Seconds from a Retry-After header (a number; dates are not sent by our service)."""
    try:
        return min(max(float(response.headers.get("retry-after", "1")), 0.05), 60.0)
    except ValueError:
        return 1.0
