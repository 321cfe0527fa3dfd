"""The one Airflow client of the project: a deployed Airflow 3 driven through its REST API
with the official client (`apache-airflow-client`): trigger a DAG run, follow it, read its
task instances, tries and logs. `rlax demo --airflow` and the local Airflow
(`airflow_local.LocalAirflow` is an `AirflowAPI` that also starts and stops the server),
the stack's tests and the UI tests all drive Airflow through it.

    api = AirflowAPI("http://127.0.0.1:8080", "admin", password)
    api.wait_for_dag("rlax_rl_training")
    run_id = api.trigger("rlax_rl_training", {"storage_root": "gs://rlax-runs/runs", ...})
    api.wait_for_run("rlax_rl_training", run_id, timeout=3600)

Only a JWT comes from elsewhere: the client has no call for Airflow's `/auth/token` (the
client's own documentation gets it with a plain POST, as `token` does here). A call that
fails because the deployment is briefly unavailable (the metadata database restarting, the
API server restarting, a locked SQLite database answering HTTP 500 "Database error") is
retried until `unavailable_s` has passed: a driver that follows a run for hours outlives
such moments. A trigger is retried only when its run id was chosen here, so a retry whose
first attempt did commit finds its own run (HTTP 409) instead of starting a second one.

The client is imported lazily (the `stack` extra); module level is stdlib only.
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

TERMINAL_RUN_STATES = ("success", "failed")
TRANSIENT_HTTP = (500, 502, 503, 504)


class AirflowError(RuntimeError):
    """Airflow refused a request, or a DAG or run did not get where it was waited for."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status of a refused request


class AirflowAPI:
    """One deployed Airflow, reached at `url` as `username`."""

    def __init__(self, url: str, username: str, password: str, unavailable_s: float = 120.0):
        self.url = url.rstrip("/")
        self.username, self.password = username, password
        self.unavailable_s = unavailable_s
        self._client: Any = None
        self._token_time = 0.0

    # ------------------------------------------------------------ plumbing
    def token(self) -> str:
        """A JWT from `/auth/token` (the simple auth manager's users and passwords)."""
        body = json.dumps({"username": self.username, "password": self.password}).encode()
        req = urllib.request.Request(
            f"{self.url}/auth/token",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=30) as resp:
            return json.loads(resp.read())["access_token"]

    def client(self) -> Any:
        """The official client's ApiClient, with a fresh token every 10 minutes."""
        import airflow_client.client as ac

        if self._client is None or time.monotonic() - self._token_time > 600:
            config = ac.Configuration(host=self.url)
            config.access_token = self._retry(self.token)
            config.proxy = None
            self._client = ac.ApiClient(config)
            self._token_time = time.monotonic()
        return self._client

    def _retry(self, call: Callable[[], Any], retry: bool = True) -> Any:
        """`call()`, retried (when `retry`) while the deployment answers 5xx or not at all."""
        import urllib3
        from airflow_client.client.exceptions import ApiException

        deadline = time.monotonic() + self.unavailable_s
        delay = 0.5
        while True:
            try:
                return call()
            except ApiException as err:
                transient = retry and err.status in TRANSIENT_HTTP
                if not transient or time.monotonic() > deadline:
                    raise AirflowError(f"HTTP {err.status}: {err.body}", err.status) from err
            except (urllib3.exceptions.HTTPError, urllib.error.URLError, OSError):
                if not retry or time.monotonic() > deadline:
                    raise
            time.sleep(delay)
            delay = min(5.0, delay * 2)

    def _api(self, name: str) -> Any:
        from airflow_client.client import api

        return getattr(api, name)(self.client())

    # ------------------------------------------------------------ calls
    def health(self, retry: bool = True) -> dict[str, Any]:
        """The API server's health answer (metadatabase, scheduler, ...); no login needed,
        so it also tells whether a starting server answers yet."""
        import airflow_client.client as ac
        from airflow_client.client import api

        config = ac.Configuration(host=self.url)
        config.proxy = None
        # Failures come back at once (and `_retry` decides): urllib3's own retries would
        # log a warning per refused connection while a server starts.
        config.retries = 0
        monitor = api.MonitorApi(ac.ApiClient(config))
        return self._retry(monitor.get_health, retry).to_dict()

    def get(self, path: str) -> Any:
        """The JSON answer of a GET below /api/v2 (listings with filters the typed calls
        above do not wrap), through the official client's transport."""
        from airflow_client.client.exceptions import ApiException

        def call() -> Any:
            client = self.client()
            headers = {
                "Accept": "application/json",
                "Authorization": f"Bearer {client.configuration.access_token}",
            }
            answer = client.call_api("GET", f"{self.url}/api/v2{path}", header_params=headers)
            answer.read()
            if answer.status >= 400:
                raise ApiException(status=answer.status, reason=answer.reason, body=answer.data)
            return json.loads(answer.data)

        return self._retry(call)

    def wait_for_dag(self, dag_id: str, timeout: float = 180.0) -> None:
        """Until the DAG processor has parsed `dag_id` (failing on import errors); unpause it."""
        from airflow_client.client.models import DAGPatchBody

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                dag = self._retry(lambda: self._api("DAGApi").get_dag(dag_id))
            except AirflowError as err:
                if err.status != 404:
                    raise
                errors = self._retry(lambda: self._api("ImportErrorApi").get_import_errors())
                if errors.import_errors:
                    raise AirflowError(
                        "DAG import errors:\n"
                        + "\n".join(e.stack_trace or "" for e in errors.import_errors)
                    ) from None
                time.sleep(2.0)
                continue
            if dag.is_paused:
                unpause = DAGPatchBody(is_paused=False)
                self._retry(lambda b=unpause: self._api("DAGApi").patch_dag(dag_id, b))
            return
        raise AirflowError(f"DAG {dag_id} not parsed after {timeout:.0f}s")

    def trigger(self, dag_id: str, conf: Mapping[str, Any], run_id: str | None = None) -> str:
        """Trigger a run of `dag_id` with `conf` (checked against its Params); its run id.

        Retried only when the run id is chosen here (see the module's docstring): a 409 of
        a caller's own run id may be someone else's run."""
        from airflow_client.client.models import TriggerDAGRunPostBody

        explicit = run_id is not None
        run_id = run_id or f"manual__rlax_{time.strftime('%Y%m%dT%H%M%S')}_{secrets.token_hex(3)}"
        body = TriggerDAGRunPostBody(dag_run_id=run_id, conf=dict(conf), logical_date=None)
        try:
            return self._retry(
                lambda: self._api("DagRunApi").trigger_dag_run(dag_id, body), retry=not explicit
            ).dag_run_id
        except AirflowError as err:
            if explicit or err.status != 409:
                raise
            if self.dag_run(dag_id, run_id).conf != dict(conf):  # not our earlier attempt
                raise
            return run_id

    def dag_run(self, dag_id: str, run_id: str) -> Any:
        return self._retry(lambda: self._api("DagRunApi").get_dag_run(dag_id, run_id))

    def task_instances(self, dag_id: str, run_id: str) -> list[Any]:
        return self._retry(
            lambda: self._api("TaskInstanceApi").get_task_instances(dag_id, run_id, limit=100)
        ).task_instances

    def tries(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> list[Any]:
        """Every try of one task instance (host, state, start and end of each)."""
        answer = self._retry(
            lambda: self._api("TaskInstanceApi").get_task_instance_tries(
                dag_id, run_id, task_id, map_index=map_index
            )
        )
        return sorted(answer.task_instances, key=lambda t: t.try_number)

    def task_log(
        self, dag_id: str, run_id: str, task_id: str, try_number: int, map_index: int = -1
    ) -> str:
        """The text of one try's task log: its events, one a line."""
        # As JSON, not the client's model of it: the model drops the structured
        # `error_detail` of a failed try (the exception a task died of).
        answer = self.get(
            f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/logs/"
            f"{try_number}?full_content=true&map_index={map_index}"
        )
        lines = []
        for item in answer.get("content") or []:
            if not isinstance(item, dict):
                lines.append(str(item))
                continue
            lines.append(str(item.get("event", "")))
            for err in item.get("error_detail") or ():  # a task's exception, structured
                if isinstance(err, dict):
                    lines.append(f"{err.get('exc_type')}: {err.get('exc_value')}")
        return "\n".join(lines)

    def check_alive(self) -> None:
        """Raise AirflowError when the deployment is known to be gone (a deployed one is
        not watched from here: nothing to check; `LocalAirflow` watches its process)."""

    def wait_for_run(
        self,
        dag_id: str,
        run_id: str,
        timeout: float,
        on_poll: Callable[[Any, list[Any]], None] | None = None,
        poll_s: float = 2.0,
    ) -> str:
        """Poll until the run is success/failed; its final state (AirflowError on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.dag_run(dag_id, run_id)
            if on_poll is not None:
                on_poll(run, self.task_instances(dag_id, run_id))
            if run.state in TERMINAL_RUN_STATES:
                return getattr(run.state, "value", run.state)  # "success", not the enum
            if time.monotonic() > deadline:
                raise AirflowError(
                    f"run {run_id} of {dag_id} still {run.state} after {timeout:.0f}s"
                )
            self.check_alive()
            time.sleep(poll_s)
