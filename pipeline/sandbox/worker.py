"""The program that runs inside the sandbox as its PID 1 and forks one child per run.

Stdlib only, and it must run under `python -s -P -S` (`isolation.WORKER_FLAGS`): the host passes this file's text with
`-c`, so no file of the project needs to be visible inside. The host imports it only for
`read_frame`/`write_frame`/`send_run`, the one definition of the protocol both sides speak:
a 4-byte big-endian length, then that many bytes of JSON, over the worker's stdin and
stdout. A run's request frame is followed by its standard input as raw bytes
(`stdin_bytes` of them), which the worker splices from the pipe into the run's memfd
without ever reading them: they never enter the worker's memory, so no later fork of it
holds them. That is what lets a run give its stdin to a child process that a program
forked before it cannot read (the code family's tests, `pipeline/tasks/code_harness.py`).

Nothing outlives a run: after each one the worker kills every process of it, empties /tmp
and /dev/shm (files, POSIX shared memory and named semaphores) and removes every System V
shared-memory segment, message queue and semaphore set of its IPC namespace (which bwrap
made for this worker alone); POSIX message queues cannot be created at all
(RLIMIT_MSGQUEUE is 0, `pipeline.sandbox.limits`). A worker that cannot clean up is
replaced.

Why PID 1: the kernel drops every signal sent to a namespace's init from inside the
namespace unless init has a handler for it, so a run cannot kill (or stop) its worker,
and orphaned descendants are re-parented to the worker, which can then kill them all with
`kill(-1, SIGKILL)` (everyone but itself) and reap them. Why fork instead of a fresh
interpreter per run: fork of this warm process costs ~1 ms, a new interpreter ~10 ms.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import resource
import selectors
import shutil
import signal
import struct
import sys
import time
import traceback

HEADER = struct.Struct("!I")
# Exit status of a run that ended with an uncaught MemoryError. A program can exit with it
# on purpose, but that only reports its own run as failed.
MEMORY_EXIT = 201
# Imported once here so that each forked run finds them warm (HumanEval-style programs
# import these); the list changes timings only, never results.
WARM_MODULES = ("typing", "math", "re", "collections", "itertools", "functools", "heapq", "string")
WIPED_DIRS = ("/tmp", "/dev/shm")
# System V IPC objects of the worker's IPC namespace, as the kernel lists them, and the
# libc call that removes one (IPC_RMID = 0): shmctl(id, IPC_RMID, NULL), msgctl(id,
# IPC_RMID, NULL), semctl(id, 0, IPC_RMID).
SYSV_IPC = {
    "/proc/sysvipc/shm": lambda libc, ident: libc.shmctl(ident, 0, None),
    "/proc/sysvipc/msg": lambda libc, ident: libc.msgctl(ident, 0, None),
    "/proc/sysvipc/sem": lambda libc, ident: libc.semctl(ident, 0, 0),
}
PR_SET_DUMPABLE = 4
CHUNK = 1 << 16
_libc = None  # libc (ctypes), bound in main()


def read_frame(fd: int) -> dict | None:
    """One message from `fd`, or None at end of file."""
    header = _read_exactly(fd, HEADER.size)
    if header is None:
        return None
    body = _read_exactly(fd, HEADER.unpack(header)[0])
    if body is None:
        return None
    return json.loads(body)


def write_frame(fd: int, message: dict) -> None:
    """Write `message` to `fd` as one frame."""
    body = json.dumps(message).encode()
    data = memoryview(HEADER.pack(len(body)) + body)
    while data:
        data = data[os.write(fd, data) :]


def send_run(fd: int, message: dict, stdin: bytes) -> None:
    """Write one run's request frame (`message` without its stdin) and then `stdin`."""
    write_frame(fd, message | {"stdin_bytes": len(stdin)})
    data = memoryview(stdin)
    while data:
        data = data[os.write(fd, data) :]


def _splice_exactly(src: int, dst: int, n: int) -> None:
    # Kernel to kernel: the bytes go from the pipe into the memfd without a copy here.
    while n:
        moved = os.splice(src, dst, n)
        if not moved:
            raise EOFError("the host closed the pipe in the middle of a run's stdin")
        n -= moved


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _exit_code(exc: SystemExit) -> int:
    # As the interpreter maps `sys.exit(x)` to a process status.
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _print_traceback(exc: BaseException) -> None:
    # From the program's frames on: this file's frame is no business of the program's.
    tb = exc.__traceback__.tb_next if exc.__traceback__ else None
    traceback.print_exception(type(exc), exc, tb)


def _run_program(code: str) -> int:
    scope = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "<program>", "exec"), scope)
        status = 0
    except SystemExit as exc:
        status = _exit_code(exc)
    except MemoryError as exc:
        status = MEMORY_EXIT
        # Printing the traceback can itself run out of memory.
        with contextlib.suppress(MemoryError):
            _print_traceback(exc)
    except BaseException as exc:
        status = 1
        _print_traceback(exc)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, MemoryError):
            stream.flush()
    return status


def _child(request: dict, stdin_fd: int, out_w: int, err_w: int) -> None:
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    # The protocol pipes, the epoll and pid fds: nothing of the worker is left to the run.
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Dumpable again, so the run can read its own /proc/self (fd, environ) as usual; the
    # worker it was forked from stays non-dumpable.
    _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    for name, (soft, hard) in request["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os._exit(_run_program(request["code"]))


def _kill_all(child: int) -> int:
    """Kill every process of the namespace but this one, reap them all, and return the
    wait status of `child` (the run's main process)."""
    child_status = 0
    while True:
        # Again each round: a process forking while the previous signal went out may
        # have left a child that it did not reach.
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        try:
            pid, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            return child_status
        if pid == child:
            child_status = wait_status


def _sysv_ids(listing: str) -> list[int]:
    """The ids (second column) of a /proc/sysvipc listing, header line skipped."""
    with open(listing) as f:
        return [int(line.split()[1]) for line in f.read().splitlines()[1:] if line.strip()]


def _wipe() -> bool:
    """Empty the run's writable directories and remove its System V IPC objects; False
    when something could not be removed (the host then replaces this worker, whose tmpfs
    and IPC namespace die with it)."""
    for listing, remove in SYSV_IPC.items():
        for ident in _sysv_ids(listing):
            remove(_libc, ident)
        if _sysv_ids(listing):
            return False
    for top in WIPED_DIRS:
        for name in os.listdir(top):
            path = os.path.join(top, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        if os.listdir(top):
            return False
    return True


def _classify(wait_status: int) -> tuple[str, int]:
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        return ("timeout" if sig == signal.SIGXCPU else "error"), -sig
    code = os.waitstatus_to_exitcode(wait_status)
    if code == MEMORY_EXIT:
        return "memory", 1
    return ("ok" if code == 0 else "error"), code


def run(request: dict, requests: int) -> dict:
    """Run one program in a forked child (its stdin spliced from `requests`) and return
    the reply frame."""
    start = time.monotonic()
    stdin_fd = os.memfd_create("stdin")
    _splice_exactly(requests, stdin_fd, request["stdin_bytes"])
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            _child(request, stdin_fd, out_w, err_w)
        finally:
            os._exit(127)
    for fd in (stdin_fd, out_w, err_w):
        os.close(fd)
    pidfd = os.pidfd_open(child)
    selector = selectors.DefaultSelector()
    for fd in (out_r, err_r, pidfd):
        selector.register(fd, selectors.EVENT_READ)
    output = {out_r: bytearray(), err_r: bytearray()}
    cap = request["output_bytes"]
    deadline = start + request["timeout_s"]
    verdict = None
    overflowed = False

    def take(fd: int) -> bool:
        # Keep at most `cap` bytes of both streams together; False at end of file or
        # once the cap is passed.
        nonlocal overflowed
        chunk = os.read(fd, CHUNK)
        room = cap - len(output[out_r]) - len(output[err_r])
        overflowed = overflowed or len(chunk) > room
        output[fd] += chunk[: max(room, 0)]
        return bool(chunk) and not overflowed

    # The run ends when its main process exits (descendants do not hold it open: a daemon
    # keeping the pipes would otherwise stretch every run to the timeout).
    while verdict is None and pidfd in selector.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            verdict = "timeout"
            break
        for key, _ in selector.select(remaining):
            if key.fd == pidfd:
                selector.unregister(pidfd)
            elif not take(key.fd):
                selector.unregister(key.fd)
                verdict = "output_limit" if overflowed else None
    wait_status = _kill_all(child)
    wall_s = time.monotonic() - start
    # Every writer is dead now: drain what the pipes still hold, up to the cap.
    for fd in (out_r, err_r):
        os.set_blocking(fd, False)
        try:
            while not overflowed and take(fd):
                pass
        except BlockingIOError:
            pass
        os.close(fd)
    os.close(pidfd)
    selector.close()
    status, returncode = _classify(wait_status)
    if overflowed:
        verdict = "output_limit"
    if verdict is not None:
        status = verdict
    return {
        "status": status,
        "returncode": returncode,
        "stdout": output[out_r].decode(errors="replace"),
        "stderr": output[err_r].decode(errors="replace"),
        "wall_s": wall_s,
        "clean": _wipe(),
    }


def main() -> None:
    # The protocol moves off fds 0 and 1, which each run gets as its own stdin/stdout.
    requests, replies = os.dup(0), os.dup(1)
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    # Non-dumpable: a run has the worker's uid, and without this could ptrace it or write
    # its memory through /proc/1/mem and so tamper with later runs.
    global _libc
    import ctypes

    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    # A run could otherwise interrupt the worker with SIGINT (it has a handler, so init's
    # protection does not cover it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The host's setup (pipeline.sandbox.isolation.worker_setup): a verifier's packages,
    # imported (and warmed up) here once so that every run forks with them loaded.
    setup = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    sys.path[:0] = setup.get("path", [])
    try:
        for name in (*WARM_MODULES, *setup.get("preload", [])):
            __import__(name)
        if setup.get("warmup"):
            exec(compile(setup["warmup"], "<warmup>", "exec"), {"__name__": "__warmup__"})
    except BaseException:
        write_frame(replies, {"ready": False, "error": traceback.format_exc(limit=-3)})
        return
    write_frame(replies, {"ready": True})
    while (request := read_frame(requests)) is not None:
        write_frame(replies, run(request, requests))


if __name__ == "__main__":
    main()
