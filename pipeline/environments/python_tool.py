"""The Python tool: a turn that ends in a fenced ```python block (`pipeline.tool_calls`)
has its program run in `pipeline.sandbox`, and the program's output comes back as the
observation.

What the observation is, by the run's status (every one of them deterministic for a
deterministic program, so a batch is the same whoever makes it and however often):

    ok            stdout + stderr
    error         stdout + stderr (the traceback names the program's lines as "<program>")
    timeout       "timeout after N s"            (the partial output is dropped: how much
    memory        "memory limit of N MB exceeded"  was printed before the kill varies)
    output_limit  "output over N bytes; the run was stopped"
    malformed     MALFORMED (a turn closing a fence it never opened; nothing runs)

each truncated to `observation_chars` (`pipeline.tool_calls.observation`). A failed call
is recorded (`StepResult.error`) and the episode continues. A turn that calls nothing ends
the episode.

No wall clock and no randomness from the host. Each run forks from a sandbox worker that
ran `DETERMINISM` once (`Limits.warmup`, trusted code, never model text): `random` is
seeded with 0; `os.urandom` (and so `secrets`, `uuid.uuid4`, `random.SystemRandom`,
`tempfile`'s names) returns bytes of a generator seeded with 0; `time.time`, `time_ns`,
`monotonic`, `perf_counter`, `process_time` (and their `_ns` forms), the default of
`time.localtime`/`gmtime`/`ctime`/`asctime`/`strftime`, `datetime.datetime.now/utcnow/today`
and `datetime.date.today` give the fixed instant FIXED_TIME. Each run starts from that
same state, and every sandbox worker hashes strings with PYTHONHASHSEED=0
(`pipeline/sandbox/isolation.py`: the order of a set of strings), so the same program
prints the same thing in any worker on any machine. Not covered (a program that goes out
of its way gets host entropy or time, and only its own row stops being reproducible):
reading /dev/urandom, and clock syscalls through ctypes. Whether a program finishes within `timeout_s` depends on the machine's
load near the limit; keep the limit far above what the task's programs need.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeline import sandbox
from pipeline.environments.base import FINAL, Environment, StepResult
from pipeline.sandbox import ExecResult, Job, Limits
from pipeline.tool_calls import TURN_STOP, call_program, is_malformed_call, observation

if TYPE_CHECKING:
    from pipeline.environments.config import EnvironmentConfig

MALFORMED = "malformed call: a closing ``` with no ```python before it"
# Output a tool run may print before it is stopped (the observation keeps far less).
OUTPUT_BYTES = 64 * 1024
FIXED_TIME = 1_700_000_000  # 2023-11-14 22:13:20 UTC: the only instant a tool program sees

# Run once per sandbox worker (trusted); every run forks from the state it leaves.
DETERMINISM = f"""\
import datetime as _dt, os as _os, random as _random, time as _time
_T = {FIXED_TIME}
_random.seed(0)
# `random` reseeds its global generator from the OS in every forked child: seed it again,
# after that hook (hooks run in the order they were registered).
_os.register_at_fork(after_in_child=lambda: _random.seed(0))
_bytes = _random.Random(0)
_os.urandom = _random._urandom = lambda n: _bytes.randbytes(n)
for _name in ("time", "monotonic", "perf_counter", "process_time", "thread_time"):
    setattr(_time, _name, lambda: float(_T))
    setattr(_time, _name + "_ns", lambda: _T * 10**9)
_lt, _gm, _st = _time.localtime, _time.gmtime, _time.strftime
_time.localtime = lambda s=None: _lt(_T if s is None else s)
_time.gmtime = lambda s=None: _gm(_T if s is None else s)
_time.ctime = lambda s=None: _time.asctime(_lt(_T if s is None else s))
_asc = _time.asctime
_time.asctime = lambda t=None: _asc(_lt(_T) if t is None else t)
_time.strftime = lambda f, t=None: _st(f, _lt(_T) if t is None else t)
class _Date(_dt.date):
    @classmethod
    def today(cls):
        return cls.fromtimestamp(_T)
class _DateTime(_dt.datetime, _Date):  # a datetime is still a date
    @classmethod
    def now(cls, tz=None):
        return cls.fromtimestamp(_T, tz)
    @classmethod
    def utcnow(cls):
        return cls.fromtimestamp(_T, _dt.timezone.utc).replace(tzinfo=None)
    @classmethod
    def today(cls):
        return cls.fromtimestamp(_T)
_dt.datetime, _dt.date = _DateTime, _Date
"""


def recorded_body(result: ExecResult, limits: Limits) -> str:
    """The observation's text for a finished run (module docstring's table)."""
    if result.status in ("ok", "error"):
        return result.stdout + result.stderr
    return {
        "timeout": f"timeout after {limits.timeout_s:g} s",
        "memory": f"memory limit of {limits.memory_mb} MB exceeded",
        "output_limit": f"output over {limits.output_bytes} bytes; the run was stopped",
    }[result.status]


class PythonTool(Environment):
    """The Python tool (module docstring): turns stop at `pipeline.tool_calls.TURN_STOP`,
    calls run in the sandbox with the configured limits."""

    name = "python"

    def __init__(self, *, observation_chars: int, timeout_s: float, memory_mb: int) -> None:
        self.stop_strings = (TURN_STOP,)
        self.observation_chars = observation_chars
        self.limits = Limits(
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            output_bytes=OUTPUT_BYTES,
            warmup=DETERMINISM,
        )

    @classmethod
    def from_config(cls, cfg: EnvironmentConfig) -> PythonTool:
        return cls(
            observation_chars=cfg.observation_chars,
            timeout_s=cfg.timeout_s,
            memory_mb=cfg.memory_mb,
        )

    def step(self, turn: str) -> StepResult:
        return self.step_many([turn])[0]

    def step_many(self, turns: Sequence[str]) -> list[StepResult]:
        """Every call among `turns` runs in one `sandbox.execute_many`, concurrently."""
        out: list[StepResult | None] = [None] * len(turns)
        calls: list[tuple[int, str]] = []
        for i, turn in enumerate(turns):
            if is_malformed_call(turn):
                out[i] = self._answer(MALFORMED, "malformed")
            elif (program := call_program(turn)) is None:
                out[i] = FINAL
            else:
                calls.append((i, program))
        if calls:
            results = sandbox.execute_many([Job(p, limits=self.limits) for _, p in calls])
            for (i, _), result in zip(calls, results, strict=True):
                error = None if result.status == "ok" else result.status
                out[i] = self._answer(recorded_body(result, self.limits), error)
        return out  # type: ignore[return-value]

    def _answer(self, body: str, error: str | None) -> StepResult:
        return StepResult(
            observation=observation(body, self.observation_chars),
            done=False,
            called=True,
            error=error,
        )
