"""Driving a deployed Airflow 3 through its REST API with the official client
(`apache-airflow-client`): trigger a DAG run, follow it, read its task instances and tries.

    api = AirflowAPI("http://127.0.0.1:8080", "admin", password)
    api.wait_for_dag("rlax_rl_training")
    run_id = api.trigger("rlax_rl_training", {"storage_root": "gs://rlax-runs/runs", ...})
    api.wait_for_run("rlax_rl_training", run_id, timeout=3600)

Only a JWT comes from elsewhere: the client has no call for Airflow's `/auth/token` (the
client's own documentation gets it with a plain POST, as `token` does here). A call that
fails because the deployment is briefly unavailable (the metadata database restarting, the
API server restarting) is retried until `unavailable_s` has passed: a driver that follows a
run for hours outlives such moments.

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

TERMINAL_RUN_STATES = ("success", "failed")
TRANSIENT_HTTP = (500, 502, 503, 504)


class AirflowAPIError(RuntimeError):
    """Airflow refused a request, or a DAG or run did not get where it was waited for."""


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

    def _retry(self, call: Callable[[], Any]) -> Any:
        """`call()`, retried while the deployment answers 5xx or not at all."""
        import urllib3
        from airflow_client.client.exceptions import ApiException

        deadline = time.monotonic() + self.unavailable_s
        delay = 0.5
        while True:
            try:
                return call()
            except ApiException as err:
                if err.status not in TRANSIENT_HTTP or time.monotonic() > deadline:
                    raise AirflowAPIError(f"HTTP {err.status}: {err.body}") from err
            except (urllib3.exceptions.HTTPError, urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise
            time.sleep(delay)
            delay = min(5.0, delay * 2)

    def _api(self, name: str) -> Any:
        from airflow_client.client import api

        return getattr(api, name)(self.client())

    # ------------------------------------------------------------ calls
    def health(self) -> dict[str, Any]:
        return self._retry(lambda: self._api("MonitorApi").get_health()).to_dict()

    def wait_for_dag(self, dag_id: str, timeout: float = 180.0) -> None:
        """Until the DAG processor has parsed `dag_id` (failing on import errors); unpause it."""
        from airflow_client.client.exceptions import NotFoundException
        from airflow_client.client.models import DAGPatchBody

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                dag = self._retry(lambda: self._api("DAGApi").get_dag(dag_id))
            except NotFoundException:
                errors = self._retry(lambda: self._api("ImportErrorApi").get_import_errors())
                if errors.import_errors:
                    raise AirflowAPIError(
                        "DAG import errors:\n"
                        + "\n".join(e.stack_trace or "" for e in errors.import_errors)
                    ) from None
                time.sleep(2.0)
                continue
            if dag.is_paused:
                unpause = DAGPatchBody(is_paused=False)
                self._retry(lambda b=unpause: self._api("DAGApi").patch_dag(dag_id, b))
            return
        raise AirflowAPIError(f"DAG {dag_id} not parsed after {timeout:.0f}s")

    def trigger(self, dag_id: str, conf: Mapping[str, Any], run_id: str | None = None) -> str:
        """Trigger a run of `dag_id` with `conf` (checked against its Params); its run id."""
        from airflow_client.client.models import TriggerDAGRunPostBody

        run_id = run_id or f"manual__rlax_{time.strftime('%Y%m%dT%H%M%S')}_{secrets.token_hex(3)}"
        body = TriggerDAGRunPostBody(dag_run_id=run_id, conf=dict(conf), logical_date=None)
        return self._retry(lambda: self._api("DagRunApi").trigger_dag_run(dag_id, body)).dag_run_id

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
        answer = self._retry(
            lambda: self._api("TaskInstanceApi").get_log(
                dag_id, run_id, task_id, try_number, full_content=True, map_index=map_index
            )
        )
        content = json.loads(answer.to_json()).get("content") or []
        return "\n".join(
            str(item.get("event", "")) if isinstance(item, dict) else str(item) for item in content
        )

    def wait_for_run(
        self,
        dag_id: str,
        run_id: str,
        timeout: float,
        on_poll: Callable[[Any, list[Any]], None] | None = None,
        poll_s: float = 2.0,
    ) -> str:
        """Poll until the run is success/failed; its final state (AirflowAPIError on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.dag_run(dag_id, run_id)
            if on_poll is not None:
                on_poll(run, self.task_instances(dag_id, run_id))
            if run.state in TERMINAL_RUN_STATES:
                return run.state
            if time.monotonic() > deadline:
                raise AirflowAPIError(
                    f"run {run_id} of {dag_id} still {run.state} after {timeout:.0f}s"
                )
            time.sleep(poll_s)
