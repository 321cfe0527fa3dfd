"""`pipeline.ops.processes`: process trees are killed whole, a group is stopped with the
signal its service asks for first, and the wing's project root is the checkout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pipeline.ops import PROJECT_ROOT, processes


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
    assert grandchild in processes.descendants(proc.pid)
    assert os.getsid(grandchild) != os.getsid(proc.pid)
    killed = processes.kill_tree(proc.pid)
    assert set(killed) >= {proc.pid, grandchild}
    assert proc.wait(10) == -9
    deadline = time.monotonic() + 10
    while processes.start_time(grandchild) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes.start_time(grandchild) is None  # gone (or a zombie awaiting init)


def test_stop_group_returns_once_the_group_is_gone_even_unreaped():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    t = time.monotonic()
    processes.stop_group(proc.pid, 30)  # SIGTERM ends it; the zombie must not count
    assert time.monotonic() - t < 10
    assert not processes.group_running(proc.pid)


def test_stop_group_sends_the_first_signal_before_sigterm(tmp_path):
    """PostgreSQL's fast shutdown is SIGINT: a service that exits on it never sees SIGTERM."""
    seen = tmp_path / "seen"
    code = (
        "import signal, sys, time\n"
        "def on(sig, _):\n"
        f"    open({str(seen)!r}, 'a').write(signal.Signals(sig).name + '\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGINT, on); signal.signal(signal.SIGTERM, on)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    processes.stop_group(proc.pid, 30, first=signal.SIGINT, reap=proc)
    assert proc.returncode == 0  # its own exit status, kept by the Popen that reaped it
    assert seen.read_text() == "SIGINT\n"


def test_project_root_is_the_checkout():
    """Every path of the wing hangs off it: the DAGs folder, the configs, the jobs' cwd."""
    assert (PROJECT_ROOT / "dags" / "rl_training.py").is_file()
    assert (PROJECT_ROOT / "configs" / "demo.yaml").is_file()
    assert (PROJECT_ROOT / "pipeline" / "ops" / "processes.py").is_file()
