"""The one place that turns a role into a command line and starts it as a process.

`rlax`, the demo and the Airflow DAGs all start jobs through here, so a laptop run and
a cluster run differ only in where the very same command lands (a local process here;
a Kubernetes pod, a TPU VM or a Dataflow job at scale).

Supervision. Every child starts in its own process group (`spawn`), so it is stopped as a
whole, and with PR_SET_PDEATHSIG: if the process that started it dies, even by SIGKILL, the
child gets SIGTERM (the trainer checkpoints on it, a worker finishes its batch). A child with
children of its own (Airflow's dozen processes) also gets a watchdog (`watchdog=True`): a
small sidecar process that stops the child's whole group when the parent dies. In the
foreground (`run_supervised`, `rlax train` and the other role commands) SIGTERM, SIGINT and
SIGHUP to the parent are forwarded to the child's group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

# role -> python module with a `main(argv)` entry point
JOBS: dict[str, str] = {
    "sft": "tpu_jobs.sft",
    "train": "tpu_jobs.trainer",
    "rollout": "tpu_jobs.rollout_worker",
    "eval": "tpu_jobs.evaluator",
    "pass-rates": "tpu_jobs.pass_rates",
    "orm": "tpu_jobs.orm",
}


def job_command(role: str, run_url: str, extra: Sequence[str] = ()) -> list[str]:
    if role not in JOBS:
        raise ValueError(f"unknown job role {role!r}; allowed: {', '.join(JOBS)}")
    return [sys.executable, "-m", JOBS[role], "--run", run_url, *extra]


# JAX's persistent compilation cache, shared by every job of this machine: a worker or
# trainer restarted after preemption, the evaluator after the workers (the same sampler
# programs) and the next run of the same config load compiled programs instead of
# compiling them again. XLA keys entries by program, compiler version and flags, so a
# hit runs the very program a fresh compile would have built. RLAX_COMPILE_CACHE picks
# the directory ("off" disables it); JAX_COMPILATION_CACHE_DIR, if set, wins.
COMPILE_CACHE_ENV = "RLAX_COMPILE_CACHE"
DEFAULT_COMPILE_CACHE = Path.home() / ".cache" / "rlax" / "jax-compile"
# Cache programs that took at least this long to compile (JAX's default, 1 s, skips most
# of the sampler's and trainer's CPU programs, each 0.1-1 s, and there are dozens).
COMPILE_CACHE_MIN_SECONDS = "0.1"


def compile_cache_env(environ: dict[str, str]) -> dict[str, str]:
    """The JAX_* variables that turn on the persistent compilation cache for a job."""
    where = environ.get(COMPILE_CACHE_ENV, str(DEFAULT_COMPILE_CACHE))
    if where.lower() == "off" or "JAX_COMPILATION_CACHE_DIR" in environ:
        return {}
    return {
        "JAX_COMPILATION_CACHE_DIR": where,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": environ.get(
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", COMPILE_CACHE_MIN_SECONDS
        ),
    }


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(compile_cache_env(env))
    return env


def module_command(module: str, args: Sequence[str]) -> list[str]:
    """`python -m MODULE ARGS` for jobs without a role (curation, HF import)."""
    return [sys.executable, "-m", module, *args]


# ----------------------------------------------------------------------- supervision

_PR_SET_PDEATHSIG = 1
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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
_PROJECT_ROOT = str(Path(__file__).resolve().parents[1])
_WATCHDOG = (
    "import sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from pipeline.launcher import watch\n"
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
            [sys.executable, "-I", "-S", "-c", _WATCHDOG, _PROJECT_ROOT]
            + [str(proc.pid), str(grace_s), str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in the group it stops
        )
    return proc


def group_alive(pgid: int) -> bool:
    """Some process of group `pgid` exists (a leader not yet reaped counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int, grace_s: float, reap: subprocess.Popen | None = None) -> None:
    """SIGTERM process group `pgid` (the trainer checkpoints on it), wait up to `grace_s`
    for all of it to be gone, then SIGKILL it. `reap`: the group leader when it is our
    child (reaped while waiting: an unreaped leader keeps the group in the process table)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and group_alive(pgid):
            if reap is None:
                time.sleep(0.2)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    reap.wait(0.2)
        if not group_alive(pgid):
            return


def exit_status(returncode: int) -> int:
    """A shell's exit status for a child's return code (128 + N when killed by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def run_supervised(cmd: Sequence[str], env: dict[str, str], grace_s: float = 60.0) -> int:
    """Run `cmd` in the foreground with inherited output, forwarding SIGTERM, SIGINT and
    SIGHUP to its process group; return its exit status."""
    proc = spawn(cmd, env=env)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():

        def forward(sig: int, _frame: Any) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        return exit_status(proc.wait())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # we are leaving by an exception: take the job with us
            stop_group(proc.pid, grace_s, reap=proc)


def start(
    role: str,
    run_url: str,
    extra: Sequence[str] = (),
    *,
    log_path: Path | None = None,
) -> subprocess.Popen:
    """Start a job; its output goes to `log_path` (or is inherited when None)."""
    cmd = job_command(role, run_url, extra)
    out = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    try:
        return spawn(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=job_env())
    finally:
        if out is not None:
            out.close()  # the child has its own descriptor


def run_job(role: str, run_url: str, extra: Sequence[str] = ()) -> int:
    """Run a job in the foreground (`rlax train`, ...) under `run_supervised`."""
    return run_supervised(job_command(role, run_url, extra), job_env())
