"""The run's `sandbox` section: where this run's verifiers execute programs."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from pipeline import sandbox
from pipeline.errors import check as _check
from pipeline.sandbox.api import URL_ALLOWED, check_url


@dataclass(frozen=True)
class SandboxConfig:
    """Where this run's verifiers execute programs (`pipeline.sandbox`, docs/sandbox.md).

    url: "" runs them in a pool of bubblewrap sandboxes inside each rollout worker and
        evaluator process; "http://host:port" (or https) sends them to a sandbox service
        (`rlax sandbox serve`, or replicas behind a load balancer). Empty also leaves
        RLAX_SANDBOX_URL of the process's environment in force.
    token_env: the environment variable holding the service's shared token; the token
        itself never enters the config (config.json is stored with the run).
    concurrency: requests one `execute_many` keeps in flight to the service (0: the
        service's own concurrency + queue, as its /health reports).
    """

    url: str = ""
    token_env: str = "RLAX_SANDBOX_TOKEN"
    concurrency: int = 0

    def __post_init__(self) -> None:
        _check(isinstance(self.url, str), "sandbox.url", self.url, URL_ALLOWED)
        if self.url:
            check_url("sandbox.url", self.url)
        _check(
            bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.token_env)),
            "sandbox.token_env",
            self.token_env,
            "an environment variable name (letters, digits, _; not starting with a digit)",
        )
        _check(self.concurrency >= 0, "sandbox.concurrency", self.concurrency, ">= 0 (0: default)")

    def apply(self) -> None:
        """Point this process's `pipeline.sandbox` at the service of `url`, with the token
        from `$token_env` (unset: none sent). With no url, nothing changes: the local pool,
        or RLAX_SANDBOX_URL when the environment sets it."""
        if self.url:
            sandbox.configure(self.url, os.environ.get(self.token_env), self.concurrency or None)
