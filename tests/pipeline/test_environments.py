"""pipeline.environments: the registry, and the Python tool's recorded observations for
calls that hang, flood, raise, exhaust memory or are malformed, run in the real sandbox;
nothing of a turn's text runs outside it."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.environments import (
    ENVIRONMENTS,
    Environment,
    StepResult,
    UnknownEnvironmentError,
    make_environment,
    register_environment,
)
from pipeline.environments.config import EnvironmentConfig
from pipeline.environments.python_tool import PythonTool
from pipeline.errors import ConfigError
from pipeline.sandbox.isolation import userns_forbidden
from pipeline.tool_calls import CALL_CLOSE, CALL_OPEN, OUTPUT_CLOSE, OUTPUT_OPEN

ROOT = Path(__file__).resolve().parents[2]
_FORBIDDEN = userns_forbidden()
needs_sandbox = pytest.mark.skipif(_FORBIDDEN is not None, reason=f"no sandbox: {_FORBIDDEN}")


def call(program: str) -> str:
    return "Let me run it.\n" + CALL_OPEN + program + CALL_CLOSE


def obs(body: str) -> str:
    return OUTPUT_OPEN + body + OUTPUT_CLOSE


@pytest.fixture(scope="module")
def tool() -> PythonTool:
    return PythonTool(observation_chars=64, timeout_s=0.3, memory_mb=128)


@needs_sandbox
def test_failed_calls_give_their_recorded_observation_and_the_episode_continues(tool):
    turns = [
        call("print(6*7)\n"),
        call("while True:\n    pass\n"),  # hangs
        call("print('x' * 10**6)\n"),  # floods past the output cap
        call("def f():\n    raise KeyError('k')\nf()\n"),  # raises
        call("x = bytearray(10**9)\n"),  # past memory_mb
        "no call here\n" + CALL_CLOSE,  # closes a fence it never opened
        "#42",  # a final answer
    ]
    got = tool.step_many(turns)
    expected = [
        StepResult(obs("42\n"), False, True, None),
        StepResult(obs("timeout after 0.3 s\n"), False, True, "timeout"),
        StepResult(
            obs("output over 65536 bytes; the run was stopped\n"), False, True, "output_limit"
        ),
        None,  # the traceback: checked below
        StepResult(obs("memory limit of 128 MB exceeded\n"), False, True, "memory"),
        StepResult(
            obs("malformed call: a closing ``` with no ```python before it\n"),
            False,
            True,
            "malformed",
        ),
        StepResult(None, True, False, None),
    ]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if e is not None:
            assert g == e, i
    raised = got[3]
    assert (raised.error, raised.done, raised.called) == ("error", False, True)
    # 64 characters: the traceback's head, cut and marked.
    assert raised.observation == obs(
        'Traceback (most recent call last):\n  File "<program>", line ...\n'
    )


@needs_sandbox
def test_a_tool_program_sees_no_host_clock_or_randomness(tool):
    program = (
        "import datetime, os, random, time, uuid\n"
        "print(time.time(), random.randint(0, 10**9), os.urandom(4).hex())\n"
        "print(datetime.datetime.now().year, uuid.uuid4().hex[:8])\n"
        "print(list({'apple', 'pear', 'fig', 'kiwi', 'plum'}))\n"  # str hash order
    )
    first, *others = tool.step_many([call(program)] * 4)
    assert all(o == first for o in others)  # four runs (forks of several workers): the same
    assert first.observation.startswith(OUTPUT_OPEN + "1700000000.0 ")
    assert "\n2023 " in first.observation


@needs_sandbox
def test_a_turn_that_writes_a_host_file_leaves_nothing_on_the_host(tool, tmp_path):
    marker = tmp_path / "marker"
    program = f"open({str(marker)!r}, 'w').write('ran outside')\nprint('done')\n"
    answer = tool.step(call(program))
    assert not marker.exists()
    assert answer.error == "error"  # no such directory inside the sandbox


def test_no_eval_or_exec_in_the_code_that_reads_model_text():
    """The environments and the episode loop never evaluate model text in-process: no call
    to eval/exec/compile/__import__ anywhere in their source."""
    files = [
        *sorted((ROOT / "pipeline/environments").glob("*.py")),
        ROOT / "tpu_jobs/generate/episodes.py",
    ]
    files.append(ROOT / "pipeline/tool_calls.py")
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec", "compile", "__import__"), path


def test_the_registry_refuses_an_unknown_name_listing_the_known_ones():
    with pytest.raises(
        UnknownEnvironmentError, match="'calc' is unknown; known environments: none, python"
    ):
        make_environment(types.SimpleNamespace(name="calc"))
    with pytest.raises(ValueError, match="already registered"):
        register_environment("python", lambda cfg: None)


def test_a_registered_environment_is_built_by_name():
    class Echo(Environment):
        name = "echo_test"
        stop_strings = ("?",)

        def step(self, turn: str) -> StepResult:
            return StepResult(f"[{turn}]", done=False)

    with pytest.raises(ConfigError, match="environment.name='echo_test'"):
        EnvironmentConfig(name="echo_test")
    register_environment("echo_test", lambda cfg: Echo())
    try:
        # Registering is all the section needs: it checks names against the registry.
        assert load_config(None, ["environment.name=echo_test"]).environment.multi_turn
        env = make_environment(types.SimpleNamespace(name="echo_test"))
        assert env.step_many(["a?", "b?"]) == [StepResult("[a?]", False), StepResult("[b?]", False)]
        assert make_environment(types.SimpleNamespace(name="none")).step("x").done
    finally:
        del ENVIRONMENTS["echo_test"]


def test_a_step_refuses_an_unknown_error_kind():
    with pytest.raises(ValueError, match="'oops' is unknown; allowed: malformed"):
        StepResult("x", False, True, "oops")


SHM_COUNTER = call("""
import ctypes, os
libc = ctypes.CDLL(None)
libc.shmat.restype = ctypes.c_void_p
counter = ctypes.c_int.from_address(libc.shmat(libc.shmget(0x5EED, 4, 0o1600), None, 0))
counter.value += 1
path = "/dev/shm/counter"
seen = int(open(path).read()) if os.path.exists(path) else 0
open(path, "w").write(str(seen + 1))
print(counter.value, seen + 1)
""")


@needs_sandbox
def test_a_tool_call_prints_the_same_whichever_worker_ran_earlier_calls(tool):
    # The counter in shared memory printed 1, 2, ... 7 across calls; each call now
    # starts from nothing, however many calls each worker of the pool ran before.
    first = tool.step(SHM_COUNTER)
    later = tool.step_many([SHM_COUNTER] * 7)
    assert first.error is None and "1 1" in first.observation
    assert [step.observation for step in later] == [first.observation] * 7
