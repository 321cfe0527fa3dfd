"""Pre-started sandbox workers, one run at a time each, shared by the threads of a process.

A worker is one bwrap sandbox whose PID 1 is `pipeline/sandbox/worker.py`; it forks a
child per run, so a run costs a fork rather than namespaces plus an interpreter start.
The host side never trusts a worker to come back: each request has a deadline (the run's
timeout plus a grace), and a worker that misses it, dies, or could not wipe its /tmp is
killed as a whole (its PID namespace goes with it) and replaced by a fresh one.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import selectors
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.sandbox import isolation
from pipeline.sandbox.limits import Limits
from pipeline.sandbox.result import ExecResult, SandboxError
from pipeline.sandbox.worker import read_frame, send_run

WORKER_SOURCE = Path(__file__).with_name("worker.py").read_text()
START_TIMEOUT_S = 30.0
# Beyond the run's own timeout: the worker's kill-and-reap of a fork bomb and its wipe.
GRACE_S = 5.0
# Every worker is started from this one long-lived thread. bwrap's --die-with-parent is
# PR_SET_PDEATHSIG, which fires when the THREAD that forked it exits, not the process:
# a worker started by a short-lived thread (an `execute_many` call's pool, a verifier's
# background thread) was killed as soon as that thread ended, and its next run came back
# as "sandbox worker died", i.e. a silent wrong answer.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawner")


class Worker:
    """One running sandbox."""

    def __init__(self, limits: Limits) -> None:
        with isolation.launch(limits, WORKER_SOURCE) as (argv, kwargs):
            self.proc = _SPAWNER.submit(
                subprocess.Popen,
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                **kwargs,
            ).result()
        ready = self._reply(START_TIMEOUT_S)
        if ready is None or not ready.get("ready"):
            self.kill()
            stderr = self.proc.stderr.read().decode(errors="replace").strip()
            why = (ready or {}).get("error") or stderr[-500:]
            raise SandboxError(
                f"a sandbox worker did not start (exit {self.proc.returncode}): {why}"
            )

    @property
    def pid(self) -> int:
        """The host pid of the worker's bwrap (killing it kills the whole sandbox)."""
        return self.proc.pid

    def _reply(self, timeout_s: float) -> dict | None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                return None
        try:
            return read_frame(self.proc.stdout.fileno())
        except (OSError, ValueError):
            return None

    def request(self, message: dict, stdin: bytes, timeout_s: float) -> dict | None:
        """Send one run (its frame, then its stdin) and wait for its reply; None when the
        worker died or hung."""
        try:
            send_run(self.proc.stdin.fileno(), message, stdin)
        except OSError:
            return None
        return self._reply(timeout_s)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


class Pool:
    """Up to `size` workers with the same mounts, started on demand and reused.

    The queue holds one item per slot: an idle worker, or None for a slot whose worker is
    not running (not started yet, or retired); whoever takes a None starts a worker.
    """

    def __init__(self, limits: Limits, size: int) -> None:
        self.limits = limits
        self.size = size
        self._slots: queue.Queue[Worker | None] = queue.Queue()
        for _ in range(size):
            self._slots.put(None)

    def warm(self) -> None:
        """Start every worker now rather than on first use."""
        workers = [self._acquire() for _ in range(self.size)]
        for worker in workers:
            self._slots.put(worker)

    def _acquire(self) -> Worker:
        worker = self._slots.get()
        if worker is not None and worker.proc.poll() is None:
            return worker
        if worker is not None:  # died while idle (killed from outside): start another
            worker.kill()
        try:
            return Worker(self.limits)
        except BaseException:
            self._slots.put(None)
            raise

    def _retire(self, worker: Worker) -> None:
        worker.kill()
        self._slots.put(None)

    def execute(self, code: str, stdin: str, limits: Limits) -> ExecResult:
        """Run `code` in one of the workers under `limits`."""
        message = {
            "code": code,
            "timeout_s": limits.timeout_s,
            "output_bytes": limits.output_bytes,
            "rlimits": limits.rlimits(),
        }
        worker = self._acquire()
        start = time.monotonic()
        try:
            reply = worker.request(message, stdin.encode(), limits.timeout_s + GRACE_S)
        except BaseException:
            self._retire(worker)
            raise
        if reply is None:
            died = worker.proc.poll() is not None
            self._retire(worker)
            status, why = ("error", "died") if died else ("timeout", "did not answer in time")
            return ExecResult(
                status, -signal.SIGKILL, "", f"sandbox worker {why}", time.monotonic() - start
            )
        if reply["clean"]:
            self._slots.put(worker)
        else:
            self._retire(worker)
        return ExecResult(
            reply["status"], reply["returncode"], reply["stdout"], reply["stderr"], reply["wall_s"]
        )

    def idle_workers(self) -> list[Worker]:
        """The workers not running a program now (for inspection: they stay in the pool)."""
        with self._slots.mutex:
            return [w for w in self._slots.queue if w is not None]

    def close(self) -> None:
        """Kill the idle workers (a run in flight keeps its worker until it returns); the
        pool starts new ones if used again."""
        for _ in range(self._slots.qsize()):
            try:
                worker = self._slots.get_nowait()
            except queue.Empty:
                return
            if worker is None:
                self._slots.put(None)
            else:
                self._retire(worker)


_POOLS: dict[tuple, Pool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(limits: Limits, size: int | None = None) -> Pool:
    """The process's pool for `limits`' mounts, created on first use (`size` defaults to
    the number of CPUs: a run is CPU-bound and one worker runs one at a time)."""
    key = limits.worker_key()
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = Pool(limits, size or os.cpu_count() or 1)
        return _POOLS[key]


@atexit.register
def close_all() -> None:
    """Kill every idle worker of every pool (bwrap's --die-with-parent covers the rest)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()
