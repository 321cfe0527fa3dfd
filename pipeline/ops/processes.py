"""Process groups: start a child in a group of its own tied to this process's life, find
and stop a group or a whole tree. The launcher's jobs, the local Airflow and the stack's
services are all started and stopped through here.

Supervision. `spawn` starts the child in its own process group (so it is stopped as a
whole) and with PR_SET_PDEATHSIG: if the process that started it dies, even by SIGKILL, the
child gets SIGTERM (the trainer checkpoints on it, a worker finishes its batch). A child
with children of its own (Airflow's dozen processes) also gets a watchdog
(`watchdog=True`): a small sidecar process that stops the child's whole group when the
parent dies.

Only the standard library: the watchdog imports this module with `python -I -S`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from pipeline.ops import PROJECT_ROOT

_PR_SET_PDEATHSIG = 1

# PR_SET_PDEATHSIG is set by a tiny exec wrapper (python -I -S: ~10 ms), not by a
# preexec_fn: Python code between fork and exec can deadlock in a multithreaded parent
# (JAX's, Airflow's), e.g. on the loader lock ctypes needs. The death signal survives exec;
# a parent that died before prctl is caught by the getppid check.
_PDEATHSIG_EXEC = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def with_parent_death_signal(cmd: Sequence[str]) -> list[str]:
    """`cmd`, wrapped so that it gets SIGTERM when this process dies, even by SIGKILL
    (Linux; elsewhere `cmd` unchanged)."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-I", "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid()), *cmd]


# The watchdog sidecar: this module run by `python -I -S` (no site-packages: ~30 ms to
# start) with the project on its path; `watch` does the rest.
_WATCHDOG = (
    "import sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from pipeline.ops.processes import watch\n"
    "watch(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))\n"
)


def watch(group: int, grace_s: float, parent: int) -> None:
    """The watchdog's body: SIGTERM when `parent` (the process that spawned the child)
    dies; then stop the child's `group` (`stop_group`). Exits by itself once the group is
    gone."""

    def stop(*_: Any) -> None:
        stop_group(group, grace_s)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the prctl
        stop()
    while group_alive(group):
        time.sleep(1.0)


def spawn(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: Any = None,
    stdout: IO[bytes] | int | None = None,
    stderr: IO[bytes] | int | None = None,
    watchdog: bool = False,
    grace_s: float = 30.0,
    umask: int = -1,
) -> subprocess.Popen:
    """Start `cmd` in its own process group, tied to this process's life (see above);
    `umask` >= 0 sets the child's file-creation mask."""
    proc = subprocess.Popen(
        with_parent_death_signal(cmd),
        env=env,
        umask=umask,
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )
    if watchdog:
        subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(PROJECT_ROOT)]
            + [str(proc.pid), str(grace_s), str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in the group it stops
        )
    return proc


# ------------------------------------------------------------------ finding processes


def _stat_fields(entry: Path) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces)."""
    return (entry / "stat").read_text().rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), None if it is gone: with
    the pid it names one process, not whatever process later reuses the number."""
    try:
        fields = _stat_fields(Path(f"/proc/{pid}"))
    except OSError:
        return None
    if fields[0] == "Z":  # a zombie is gone for our purposes
        return None
    return int(fields[19])


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, across sessions and process groups (jobs the launcher
    started in groups of their own included)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(entry)[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def group_alive(pgid: int) -> bool:
    """Some process of group `pgid` exists (a leader not yet reaped counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_running(pgid: int) -> bool:
    """A process of group `pgid` still runs (zombies, which an unreaped child leaves when
    it was started by this very process, do not count; `group_alive` counts them)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(entry)
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# ------------------------------------------------------------------ stopping processes


FIRST_SIGNAL_GRACE_S = 5.0  # stop_group: how long `first` alone may take


def stop_group(
    pgid: int,
    grace_s: float,
    *,
    first: int = signal.SIGTERM,
    reap: subprocess.Popen | None = None,
) -> None:
    """Stop process group `pgid`: signal it with `first` (PostgreSQL's fast shutdown is
    SIGINT) and wait up to FIRST_SIGNAL_GRACE_S for it, then SIGTERM (the trainer checkpoints on it) and wait up to `grace_s` for all
    of it to be gone, then SIGKILL. `reap`: the group leader when it is our `Popen` child,
    reaped while waiting (its exit status stays with it), and the call returns once every
    process of the group is gone and reaped; without `reap` zombies do not count as running
    (the leader may be an unreaped child of ours: it is reaped at the end)."""
    alive = group_running if reap is None else group_alive
    plan = [(signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)]
    if first != signal.SIGTERM:
        # Give the first signal its own short grace: a process exiting on it must not get
        # SIGTERM mid-exit (Python restores default handlers while it shuts down).
        plan.insert(0, (first, min(grace_s, FIRST_SIGNAL_GRACE_S)))
    for sig, wait in plan:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and alive(pgid):
            if reap is None or reap.poll() is not None:
                time.sleep(0.2)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    reap.wait(0.2)
        if not alive(pgid):
            break
    if reap is not None:
        reap.poll()
    else:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pgid, os.WNOHANG)


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and everything below it at once, as losing the machine would: all are
    stopped first (SIGSTOP), so none sees its parent die and reacts (the launcher's jobs
    get SIGTERM on their parent's death and would checkpoint). Returns the pids killed."""
    victims = [pid, *descendants(pid)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
    return victims
