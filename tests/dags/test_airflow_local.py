"""pipeline/ops/airflow_local.py and the CLI entry points, without starting Airflow."""

from __future__ import annotations

import json

import pytest

from pipeline.ops.airflow_local import (
    PASSWORDS_FILE,
    ProgressPrinter,
    airflow_env,
    ensure_password,
    task_label,
)
from pipeline.ops.cli import build_parser
from tests.dags.conftest import DAGS
from tests.local_servers import QuietHandler


def test_env_binds_localhost_and_points_tasks_at_the_api_port(tmp_path):
    env = airflow_env(tmp_path, 18123, parallelism=5)
    assert env["AIRFLOW_HOME"] == str(tmp_path)
    assert env["AIRFLOW__API__HOST"] == "127.0.0.1"
    assert env["AIRFLOW__API__PORT"] == "18123"
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:18123/execution/"
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert env["AIRFLOW__CORE__PARALLELISM"] == "5"
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == str(DAGS)
    assert env["PATH"].split(":")[0].endswith("/bin")  # the venv's airflow for subprocesses
    assert len(env["AIRFLOW__API_AUTH__JWT_SECRET"]) >= 64
    assert env["AIRFLOW__API__SECRET_KEY"] != env["AIRFLOW__API_AUTH__JWT_SECRET"]
    ports = {env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"], "8793", "8794"}
    assert len(ports | {env["AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT"]}) == 4
    assert (
        airflow_env(tmp_path, 1)["AIRFLOW__API_AUTH__JWT_SECRET"]
        == (env["AIRFLOW__API_AUTH__JWT_SECRET"])
    )


def test_password_is_generated_once_and_kept(tmp_path):
    pw = ensure_password(tmp_path)
    assert len(pw) >= 12 and ensure_password(tmp_path) == pw
    assert json.loads((tmp_path / PASSWORDS_FILE).read_text()) == {"admin": pw}
    assert (tmp_path / PASSWORDS_FILE).stat().st_mode & 0o077 == 0


def test_cli_has_the_airflow_entry_points():
    args = build_parser().parse_args(["demo", "--airflow", "--workers", "2", "trainer.steps=3"])
    assert args.airflow and args.workers == 2 and args.overrides == ["trainer.steps=3"]
    assert not build_parser().parse_args(["demo"]).airflow
    args = build_parser().parse_args(["airflow", "--port", "0"])
    assert args.port == 0 and args.func.__name__ == "cmd_airflow"


def test_progress_prints_state_changes_once(capsys):
    printer = ProgressPrinter()
    tis = [
        {"task_id": "train", "map_index": -1, "state": "running", "try_number": 1},
        {"task_id": "rollout_worker", "map_index": 0, "state": "running", "try_number": 1,
         "rendered_map_index": "worker0"},
    ]  # fmt: skip
    printer({}, tis)
    printer({}, tis)
    tis[0] = {**tis[0], "state": "up_for_retry", "try_number": 2}
    printer({}, tis)
    out = capsys.readouterr().out
    assert out.count("rollout_worker[worker0]") == 1
    assert "train" in out and "up_for_retry (try 2)" in out
    assert task_label({"task_id": "t", "map_index": 3}) == "t[3]"


class JSONHandler(QuietHandler):
    """Answers like Airflow's API server: JSON bodies."""

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _LockedDatabaseAPI:
    """An HTTP server on 127.0.0.1 answering like Airflow's API server when its SQLite
    database stays locked: the first trigger commits the run and still answers HTTP 500
    "Database error" (the ambiguous case), GETs fail once the same way."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.runs: dict[str, dict] = {}
        self.posts = 0
        self.gets = 0
        api = self

        class Handler(JSONHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/auth/token":
                    return self._send(201, {"access_token": "t"})
                api.posts += 1
                run_id = body["dag_run_id"]
                if run_id in api.runs:
                    return self._send(409, {"detail": "DAG run exists"})
                api.runs[run_id] = {
                    "dag_run_id": run_id, "conf": body["conf"], "dag_id": "rlax_rl_training",
                    "dag_display_name": "rlax_rl_training", "dag_versions": [],
                    "run_after": "2026-01-01T00:00:00Z", "run_type": "manual", "state": "queued",
                }  # fmt: skip
                return self._send(500, {"detail": {"reason": "Database error"}})

            def do_GET(self):  # noqa: N802
                api.gets += 1
                if api.gets == 1:
                    return self._send(500, {"detail": {"reason": "Database error"}})
                run_id = self.path.rsplit("/", 1)[-1]
                return self._send(200, api.runs[run_id])

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]


def test_trigger_survives_a_locked_database_without_a_second_run(tmp_path):
    from pipeline.ops.airflow_local import AirflowError, LocalAirflow

    api = _LockedDatabaseAPI()
    try:
        af = LocalAirflow(home=tmp_path, port=api.port)
        af.password = ensure_password(tmp_path)
        run_id = af.trigger("rlax_rl_training", {"run_id": "r1"})
        # The first POST committed and failed; the retry found the run (409) and the
        # client confirmed it is its own (same conf) after a retried GET: one run.
        assert list(api.runs) == [run_id] and api.posts == 2 and api.gets == 2
        # A caller-chosen run id is not retried: a 409 may be someone else's run.
        api.gets = 1
        with pytest.raises(AirflowError, match="Database error") as err:
            af.trigger("rlax_rl_training", {"run_id": "r2"}, run_id="mine")
        assert err.value.status == 500 and api.posts == 3
    finally:
        api.server.shutdown()


def test_task_log_keeps_the_exception_a_try_died_of(tmp_path):
    """The client reads a try's log as the API's JSON: the structured `error_detail` (where
    `trainer was killed by SIGKILL` is) comes with the events, and a 404 is AirflowError."""
    import http.server
    import threading

    from pipeline.ops.airflow_local import LocalAirflow
    from pipeline.ops.airflow_rest import AirflowError

    seen: list[str] = []
    log = {
        "content": [
            {"event": "[trainer] step 2"},
            {
                "event": "Task failed with exception",
                "error_detail": [{"exc_type": "JobFailed", "exc_value": "killed by SIGKILL"}],
            },
        ]
    }

    class Handler(JSONHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            self._send(201, {"access_token": "t"})

        def do_GET(self):  # noqa: N802
            seen.append(self.path)
            self._send(200, log) if "/logs/1?" in self.path else self._send(404, {"detail": "x"})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        af = LocalAirflow(home=tmp_path, port=server.server_address[1])
        text = af.task_log("rlax_rl_training", "manual__a+b", "train", 1)
        assert text.splitlines() == [
            "[trainer] step 2",
            "Task failed with exception",
            "JobFailed: killed by SIGKILL",
        ]
        assert seen[0] == (
            "/api/v2/dags/rlax_rl_training/dagRuns/manual__a%2Bb/taskInstances/train/logs/1"
            "?full_content=true&map_index=-1"
        )
        with pytest.raises(AirflowError, match="HTTP 404") as err:
            af.task_log("rlax_rl_training", "manual__a+b", "train", 2)
        assert err.value.status == 404
    finally:
        server.shutdown()


def test_waiting_on_a_local_airflow_that_died_fails_at_once(tmp_path):
    import subprocess
    import sys

    from pipeline.ops.airflow_local import LocalAirflow
    from pipeline.ops.airflow_rest import AirflowError

    af = LocalAirflow(home=tmp_path)
    af.check_alive()  # never started: nothing to watch
    af.proc = subprocess.Popen([sys.executable, "-c", "pass"])
    af.proc.wait()
    with pytest.raises(AirflowError, match="airflow standalone died"):
        af.check_alive()
