"""`pipeline.ops.stack` without starting its services (tests/stack/ starts them): process trees
are killed whole, and a recorded pid counts only while it names the process `up` started."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pipeline.ops import stack


def _tree() -> tuple[subprocess.Popen, int]:
    """A process with a grandchild in a session of its own (as the launcher starts jobs)."""
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True, text=True
    )
    grandchild = int(proc.stdout.readline())
    return proc, grandchild


def test_kill_tree_kills_descendants_in_other_sessions():
    proc, grandchild = _tree()
    assert grandchild in stack.descendants(proc.pid)
    assert os.getsid(grandchild) != os.getsid(proc.pid)
    killed = stack.kill_tree(proc.pid)
    assert set(killed) >= {proc.pid, grandchild}
    assert proc.wait(10) == -9
    deadline = time.monotonic() + 10
    while stack.start_time(grandchild) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.start_time(grandchild) is None  # gone (or a zombie awaiting init)


def test_a_reused_pid_is_not_ours_and_down_leaves_it_alone(tmp_path):
    st = stack.Stack(root=tmp_path)
    me = os.getpid()
    st.procs["redis"] = {"pid": me, "start": stack.start_time(me) - 1, "log": ""}
    st.save()
    assert not stack.Stack.load(tmp_path).running("redis")
    stack.down(tmp_path, log=lambda _: None)  # would stop this very process if it trusted the pid
    assert stack.start_time(me) is not None
    assert stack.Stack.load(tmp_path).procs == {}


def test_stop_group_returns_once_the_group_is_gone_even_unreaped():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    t = time.monotonic()
    stack.stop_group(proc.pid, 15, grace_s=30)  # SIGTERM ends it; the zombie must not count
    assert time.monotonic() - t < 10
    assert not stack.group_running(proc.pid)


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
