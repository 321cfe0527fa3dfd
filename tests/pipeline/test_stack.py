"""`pipeline.ops.stack` without starting its services (tests/stack/ starts them): a recorded
pid counts only while it names the process `up` started (process groups and trees:
test_processes.py)."""

from __future__ import annotations

import os

from pipeline.ops import processes, stack


def test_a_reused_pid_is_not_ours_and_down_leaves_it_alone(tmp_path):
    st = stack.Stack(root=tmp_path)
    me = os.getpid()
    st.procs["redis"] = {"pid": me, "start": processes.start_time(me) - 1, "log": ""}
    st.save()
    assert not stack.Stack.load(tmp_path).running("redis")
    stack.down(tmp_path, log=lambda _: None)  # would stop this very process if it trusted the pid
    assert processes.start_time(me) is not None
    assert stack.Stack.load(tmp_path).procs == {}


def test_status_of_a_stack_never_started(tmp_path):
    rows = stack.status(tmp_path)
    assert [r["service"] for r in rows] == [s.name for s in stack.SERVICES]
    assert not any(r["running"] or r["healthy"] for r in rows)


def test_unknown_service_is_refused_with_the_allowed_names(tmp_path, capsys):
    assert stack.main(["restart", "mysql", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "unknown service 'mysql'" in err and "postgres" in err


def test_mlflow_is_started_only_when_asked_and_binds_loopback(tmp_path, monkeypatch):
    monkeypatch.delenv(stack.MLFLOW_ENV, raising=False)
    svc = stack.SERVICES_BY_NAME["mlflow"]
    assert "--mlflow" in svc.available()
    monkeypatch.setenv(stack.MLFLOW_ENV, "1")
    assert svc.available() is None
    s = stack.Stack(root=tmp_path)
    cmd = svc.command(s)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == str(s.ports["mlflow"])
    assert cmd[cmd.index("--backend-store-uri") + 1] == f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    # (started for real by tests/pipeline/test_tracking.py's mlflow_server fixture)
