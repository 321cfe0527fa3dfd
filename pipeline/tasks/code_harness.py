"""The code family's test harness: it runs a problem's tests in a process that the
candidate program cannot inspect or reach, and calls the program in another one.

Stdlib only: `code_task` sends this file's text as a sandbox run's code (with the program
appended as `main(<program>)`) and the tests as the run's stdin. Inside the run:

1. The run's process (the *harness*) makes itself non-dumpable, then forks the
   *candidate*, which has not seen the tests: they are still in the run's stdin, which
   the sandbox worker spliced into a memfd without reading (`pipeline/sandbox/worker.py`),
   so neither the worker's memory nor the harness's holds them when the candidate is
   forked. The candidate gets /dev/null as stdin and the run's stderr as its stdout and
   stderr; it runs the program as `__main__` and then answers calls over two pipes.
2. The harness reads the tests, executes the problem's trusted prefix (HumanEval's prompt:
   helpers such as `poly` or `encode_cyclic` that the tests use, so a program cannot
   redefine them) where it compiles on its own, binds every function the program defines
   at top level to a proxy, and runs the tests (then `check(entry_point)`). A proxy sends
   its arguments to the candidate and returns the candidate's reply.
3. Arguments and results cross as plain data only: None, bool, int, float, complex, str,
   bytes, list, tuple, set, frozenset and dict of those, exact types (`encode`), decoded
   by the harness into fresh builtin objects (`decode`). An object with its own `__eq__`
   cannot be sent, and whatever bytes a candidate writes decode to plain values or to an
   error, so the tests' comparisons are between builtins the candidate did not make.
4. Only the harness holds the run's stdout: after the tests it writes `MARKER` there, and
   the grader passes a run only when its stdout is exactly that line and it exited 0.

Why that is sound: the candidate's process has no frame, object or byte of the harness
(fork before the tests were read; the harness is non-dumpable, so /proc/<pid>/mem, its fds
and ptrace (also refused by seccomp) are closed to a process of the same uid), and it has
no descriptor of the run's stdout. What it can do to the harness: answer with plain values
(what a correct program does), answer with an error, exit, or kill or stop it; all but the
first fail the run. Exiting early (`sys.exit(0)`, `os._exit(0)`) ends the candidate, the
next call finds its pipe closed, and the harness fails.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import struct
import sys
import traceback

MARKER = "rlax-tests-passed"
HEADER = struct.Struct("!I")
# A reply larger than this is refused (a candidate flooding the harness's memory).
MAX_REPLY_BYTES = 16 << 20
PR_SET_DUMPABLE = 4
# The candidate's descriptors: it reads calls on CALLS and writes replies on REPLIES.
CALLS, REPLIES = 3, 4
PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes)
# Containers by the tag they travel under; a list travels as a JSON array.
CONTAINERS = {"tuple": tuple, "set": set, "frozenset": frozenset}


class CandidateError(Exception):
    """The candidate raised, sent something that is not plain data, or is gone."""


def encode(value: object) -> object:
    """`value` as JSON-able data, exact builtin types only (TypeError otherwise)."""
    kind = type(value)
    if kind is list:
        return [encode(v) for v in value]
    if kind is dict:
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    for tag, container in CONTAINERS.items():
        if kind is container:
            return {tag: [encode(v) for v in value]}
    if kind in PLAIN_TYPES:
        return value
    raise TypeError(f"a {kind.__name__} is not plain data (allowed: {ALLOWED})")


ALLOWED = "None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict"


def _tagged(pairs: list) -> object:
    if len(pairs) != 1:
        raise ValueError("a JSON object that is not one tagged value")
    ((tag, items),) = pairs
    if tag == "dict":
        return {k: v for k, v in items}
    if tag == "bytes":
        return bytes.fromhex(items)
    if tag == "complex":
        return complex(float(items[0]), float(items[1]))
    if tag in CONTAINERS:
        return CONTAINERS[tag](items)
    raise ValueError(f"unknown tag {tag!r}")


def decode(text: bytes) -> object:
    """Fresh builtin objects from `encode`'s JSON; ValueError/TypeError on anything else."""
    return json.loads(text, object_pairs_hook=_tagged)


def _send(fd: int, message: object) -> None:
    body = json.dumps(message).encode()
    data = memoryview(HEADER.pack(len(body)) + body)
    while data:
        data = data[os.write(fd, data) :]


def _read_exactly(fd: int, n: int) -> bytes:
    parts = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise CandidateError("the program ended (exited or crashed) before answering")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _receive(fd: int, limit: int = MAX_REPLY_BYTES) -> bytes:
    (size,) = HEADER.unpack(_read_exactly(fd, HEADER.size))
    if size > limit:
        raise CandidateError(f"a reply of {size} bytes (at most {limit})")
    return _read_exactly(fd, size)


# ------------------------------------------------------------------- the candidate


def _serve(program: str) -> None:
    """Run `program`, report the names of its top-level callables, then answer calls
    until the harness closes the pipe. Runs in the candidate's process only."""
    scope = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(program, "<program>", "exec"), scope)
    names = sorted(k for k, v in scope.items() if callable(v) and not k.startswith("__"))
    _send(REPLIES, ["names", names])
    while True:
        try:
            name, args, kwargs = decode(_receive(CALLS, 1 << 62))
        except CandidateError:
            return  # the harness is done
        try:
            reply = ["value", encode(scope[name](*args, **kwargs))]
        except Exception as exc:  # the program's own failure is the harness's to judge
            reply = ["error", f"{type(exc).__name__}: {exc}"[:1000]]
        _send(REPLIES, reply)


def _candidate(program: str, calls: int, replies: int) -> None:
    os.dup2(calls, CALLS)
    os.dup2(replies, REPLIES)
    os.dup2(2, 1)  # stdout is the harness's verdict channel: the program prints to stderr
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)  # the run's stdin (the tests' memfd) is not the program's
    os.closerange(REPLIES + 1, os.sysconf("SC_OPEN_MAX"))
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    status = 0
    try:
        _serve(program)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


# --------------------------------------------------------------------- the harness


class _Proxy:
    """Stands for the program's function `name` in the tests: each call is one round
    trip to the candidate with plain-data arguments and result."""

    def __init__(self, name: str, calls: int, replies: int) -> None:
        self.__name__ = name
        self._calls, self._replies = calls, replies

    def __call__(self, *args: object, **kwargs: object) -> object:
        _send(self._calls, [self.__name__, encode(list(args)), encode(kwargs)])
        kind, payload = _decode_reply(_receive(self._replies), self.__name__)
        if kind != "value":
            raise CandidateError(f"{self.__name__} raised {payload}")
        return payload


def _decode_reply(body: bytes, what: str) -> list:
    """A candidate's frame, `[kind, payload]` of plain data; CandidateError otherwise."""
    try:
        reply = decode(body)
    except (ValueError, TypeError, RecursionError) as exc:
        raise CandidateError(f"{what}: a reply that is not plain data ({exc})") from None
    if type(reply) is not list or len(reply) != 2 or reply[0] not in ("value", "error", "names"):
        raise CandidateError(f"{what}: a reply of the wrong shape")
    return reply


def _trusted_prefix(prefix: str) -> object | None:
    # A continuation prefix (`def f(x): return `) is not a module: it defines nothing.
    try:
        return compile(prefix, "<prefix>", "exec")
    except SyntaxError:
        return None


def main(program: str) -> None:
    """The run: fork the candidate, then run the tests from stdin against it."""
    import ctypes

    # Before the fork: the candidate is born non-dumpable too, and the harness stays so
    # once it holds the tests.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    calls_r, calls_w = os.pipe()
    replies_r, replies_w = os.pipe()
    if os.fork() == 0:
        try:
            _candidate(program, calls_r, replies_w)
        finally:
            os._exit(1)
    os.close(calls_r)
    os.close(replies_w)
    verdict = os.dup(1)
    sys.stdout = sys.stderr  # what the tests print must not mix with the verdict
    tests = json.loads(sys.stdin.buffer.read())
    kind, names = _decode_reply(_receive(replies_r), "the program's names")
    if kind != "names" or type(names) is not list:
        raise CandidateError("the program's first frame is not its names")
    scope: dict[str, object] = {"__name__": "__main__", "__builtins__": builtins}
    for name in names:
        if type(name) is str and name.isidentifier():
            scope[name] = _Proxy(name, calls_w, replies_r)
    prefix = _trusted_prefix(tests.get("prefix") or "")
    if prefix is not None:
        exec(prefix, scope)
    entry = tests.get("entry_point")
    if entry:
        scope[entry] = _Proxy(entry, calls_w, replies_r)
    exec(compile(tests["tests"], "<tests>", "exec"), scope)
    if entry:
        scope["check"](scope[entry])
    os.write(verdict, (MARKER + "\n").encode())
