"""The code family: programs extracted from completions, run in the real sandbox against
HumanEval-style tests and stdin/stdout cases; HumanEval's own canonical solutions are the
reference (all 164 pass), and gutted bodies are the counter-check (all 164 fail)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import pytest

from pipeline.sandbox import SandboxError, execute
from pipeline.sandbox.isolation import userns_forbidden
from pipeline.tasks import TASKS, get_task
from pipeline.tasks import code_task as ct
from pipeline.tasks.base import make_problem
from pipeline.tasks.datasets import DATASETS, load_dataset

ROOT = Path(__file__).resolve().parents[2]
_FORBIDDEN = userns_forbidden()
sandboxed = pytest.mark.skipif(_FORBIDDEN is not None, reason=f"no sandbox here: {_FORBIDDEN}")

CODE = get_task("code")


@pytest.fixture(scope="module")
def humaneval():
    return load_dataset("humaneval")


def io_problem(cases, **meta):
    return make_problem("code", "echo the sum", "", {"io": cases, **meta})


def asserts_problem(tests, entry_point=None, **meta):
    meta = {"tests": tests, **({"entry_point": entry_point} if entry_point else {}), **meta}
    return make_problem("code", f"problem {tests}", "", meta)


# ---------------------------------------------------------------- HumanEval, for real


def test_humaneval_loads_all_164_problems_offline(humaneval):
    assert len(humaneval) == 164 and "humaneval" in DATASETS
    assert [p.meta["task_id"] for p in humaneval[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert len({p.problem_id for p in humaneval}) == 164
    first = humaneval[0]
    assert first.task == "code" and first.meta["entry_point"] == "has_close_elements"
    assert first.meta["prefix"] in first.prompt and "```python" in first.prompt
    assert first.answer.startswith(first.meta["prefix"])  # prompt + canonical solution
    for p in humaneval:
        CODE.check_problem(p)


@sandboxed
def test_all_164_canonical_solutions_pass(humaneval, capsys):
    start = time.perf_counter()
    rewards = CODE.verify_batch(humaneval, [p.answer for p in humaneval])
    seconds = time.perf_counter() - start
    assert rewards == [1.0] * 164
    with capsys.disabled():
        print(f"\n[code] 164 canonical HumanEval checks: {seconds:.2f}s, {164 / seconds:.0f}/s")
    # The same programs as an instruct model writes them: prose around a fence.
    fenced = [f"Here it is:\n```python\n{p.answer}```\nIt is O(n)." for p in humaneval]
    assert CODE.verify_batch(humaneval, fenced) == [1.0] * 164


@sandboxed
def test_a_continuation_of_the_prompt_is_scored_behind_it(humaneval):
    # HumanEval's classic setting: the completion is the body alone.
    bodies = [p.answer.removeprefix(p.meta["prefix"]) for p in humaneval]
    assert CODE.verify_batch(humaneval, bodies) == [1.0] * 164


@sandboxed
@pytest.mark.parametrize("body", ["    pass\n", "    return None\n"])
def test_every_gutted_solution_fails(humaneval, body):
    # Measured: no HumanEval test suite accepts a body that does nothing (0 of 164),
    # whether written as a continuation or as a whole fenced program.
    as_body = [body] * 164
    as_program = [f"```python\n{p.meta['prefix']}{body}```" for p in humaneval]
    assert CODE.verify_batch(humaneval * 2, as_body + as_program) == [0.0] * 328


# ------------------------------------------------------------------------ extraction


@pytest.mark.parametrize(
    ("completion", "program"),
    [
        ("print(1)", "print(1)\n"),
        ("\n\nx = 1   \nprint(x)\n\n", "x = 1\nprint(x)\n"),
        ("a\n```python\nprint(1)\n```\nb\n```python\nprint(2)\n```\nc", "print(2)\n"),
        ("```py\nprint(1)\n```", "print(1)\n"),
        ("```\nprint(1)\n```", "print(1)\n"),  # an untagged fence is taken as Python
        ("```python\nprint(1)\n```\n```bash\nls\n```", "print(1)\n"),  # last PYTHON block
        ("```python\nprint(1)\n```\n```text\nok\n```", "print(1)\n"),
        ("```python\nprint(1)", "print(1)\n"),  # generation stopped before the fence closed
        ("1. step\n   ```python\n   if x:\n       y()\n   ```", "if x:\n    y()\n"),
        ("    return x + 1\n", "    return x + 1\n"),  # a continuation keeps its indentation
        ("s = 'a ``` b'\n", "s = 'a ``` b'\n"),  # backticks inside a line are no fence
    ],
)
def test_the_program_is_the_last_python_fence_or_the_whole_text(completion, program):
    assert ct.extract_program(completion) == program
    assert CODE.extract_answer(completion) == program


@pytest.mark.parametrize("completion", ["", "  \n\n", "```bash\nls\n```", "```python\n```"])
def test_no_program_is_none(completion):
    assert CODE.extract_answer(completion) is None


def test_answers_differing_only_in_spacing_vote_together():
    a = CODE.extract_answer("```python\ndef f():  \n    return 1\n```")
    b = CODE.extract_answer("Sure.\n```python\n\ndef f():\n    return 1\n\n```\n")
    assert a == b == "def f():\n    return 1\n"


def test_the_prefix_goes_in_front_only_when_the_entry_point_is_missing():
    p = asserts_problem("assert f() == 1", "f", prefix="def f():\n")
    assert ct.program_for(p, "    return 1") == "def f():\n    return 1\n"
    assert ct.program_for(p, "def f():\n    return 1") == "def f():\n    return 1\n"
    assert ct.program_for(p, "async def f():\n    return 1").startswith("async def f")


# ------------------------------------------------------------------ io and behaviours


SUM = "a, b = map(int, input().split())\nprint(a + b)"


@sandboxed
def test_io_cases_pass_up_to_trailing_whitespace_and_fail_on_a_wrong_output():
    p = io_problem([{"stdin": "1 2\n", "stdout": "3"}, {"stdin": "5 5", "stdout": "10\n\n"}])
    completions = [
        SUM,
        "a, b = map(int, input().split())\nprint(a + b, end='   \\r\\n\\n\\n')",
        "a, b = map(int, input().split())\nprint(' ', a + b)",  # leading space counts
        "print(3)",  # right on the first case only
        "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)",
    ]
    # A right output with a non-zero exit is a runtime error, as on a judge.
    assert CODE.verify_batch([p] * len(completions), completions) == [1.0, 1.0, 0.0, 0.0, 0.0]


@sandboxed
def test_an_infinite_loop_times_out_quickly_to_zero():
    p = io_problem([{"stdin": "", "stdout": "1"}], timeout_s=0.5)
    start = time.perf_counter()
    assert CODE.verify(p, "while True:\n    pass") == 0.0
    assert time.perf_counter() - start < 5


@sandboxed
def test_tests_kind_composes_like_humaneval_and_catches_an_early_exit():
    p = asserts_problem("def check(candidate):\n    assert candidate(2) == 4\n", "double")
    assert CODE.verify(p, "def double(x):\n    return 2 * x") == 1.0
    assert CODE.verify(p, "def double(x):\n    return x + 1") == 0.0
    # Exiting with status 0 before the tests run (HumanEval's exec would report it failed).
    assert CODE.verify(p, "def double(x):\n    return 0\nimport sys\nsys.exit(0)") == 0.0
    assert CODE.verify(p, "def double(x):\n    return 0\nimport os\nos._exit(0)") == 0.0
    # A program that hides its own stdout still passes on merit.
    hidden = "import io, sys\nsys.stdout = io.StringIO()\ndef double(x):\n    return 2 * x"
    assert CODE.verify(p, hidden) == 1.0
    assert CODE.verify(p, "```bash\necho hi\n```") == 0.0  # no program at all
    # Asserts without an entry point (MBPP style).
    mbpp = asserts_problem("assert double(3) == 6\nassert double(0) == 0")
    assert CODE.verify(mbpp, "double = lambda x: 2 * x") == 1.0


@sandboxed
def test_escape_attempts_score_zero_and_leave_the_host_alone(tmp_path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(3)
        port = server.getsockname()[1]
        accepted = []
        threading.Thread(target=lambda: _accept(server, accepted), daemon=True).start()
        marker = ROOT / f"escaped-{port}"
        passwd = Path("/etc/passwd").read_text()
        p = io_problem([{"stdin": "", "stdout": passwd}])
        attempts = [
            "print(open('/etc/passwd').read(), end='')",
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\n"
            + "print(open('/etc/passwd').read(), end='')",
            f"open({str(marker)!r}, 'w').write('x')\nprint(open('/etc/passwd').read(), end='')",
            f"open({str(tmp_path / 'x')!r}, 'w').write('x')",
        ]
        assert CODE.verify_batch([p] * len(attempts), attempts) == [0.0] * len(attempts)
        time.sleep(0.5)
    assert accepted == []
    assert not marker.exists() and not (tmp_path / "x").exists()


def _accept(server: socket.socket, accepted: list) -> None:
    with contextlib.suppress(OSError):  # the accept timed out: nobody came
        accepted.append(server.accept())


def test_a_broken_sandbox_raises_instead_of_scoring_zero(monkeypatch):
    def broken(jobs, **kwargs):
        raise SandboxError("bwrap is missing")

    monkeypatch.setattr(ct, "execute_many", broken)
    with pytest.raises(SandboxError, match="bwrap"):
        CODE.verify_batch([io_problem([{"stdin": "", "stdout": ""}])], ["print()"])


def test_one_execute_many_call_runs_every_case_of_the_batch(monkeypatch):
    calls = []

    def fake(jobs, **kwargs):
        calls.append([j.stdin for j in jobs])
        from pipeline.sandbox import ExecResult

        return [ExecResult("ok", 0, j.stdin, "", 0.0) for j in jobs]

    monkeypatch.setattr(ct, "execute_many", fake)
    echo = io_problem([{"stdin": "a", "stdout": "a"}, {"stdin": "b", "stdout": "b"}])
    other = io_problem([{"stdin": "c", "stdout": "d"}])
    assert CODE.verify_batch([echo, other, echo], ["x", "x", "```sh\nx\n```"]) == [1.0, 0.0, 0.0]
    assert calls == [["a", "b", "c"]]  # the third completion has no program: no run


# -------------------------------------------------------------------- problem checks


def test_code_is_a_registered_family():
    assert TASKS["code"] is CODE and isinstance(CODE, ct.CodeTask)


@pytest.mark.parametrize(
    ("meta", "says"),
    [
        ({}, "has no tests"),
        ({"answer_hint": 1}, "has no tests"),
        ({"tests": "  "}, "'tests' must be non-empty"),
        ({"tests": "assert 1", "entry_point": "not valid"}, "not a Python identifier"),
        ({"entry_point": "f", "io": [{"stdin": "", "stdout": ""}]}, "without 'tests'"),
        ({"io": []}, "non-empty list"),
        ({"io": [{"stdin": "1"}]}, r"io\[0\] must be an object"),
        ({"io": [{"stdin": 1, "stdout": "1"}]}, r"io\[0\]"),
        ({"tests": "assert 1", "timeout_s": 0}, "timeout_s=0 is invalid"),
        ({"tests": "assert 1", "timeout_s": "5"}, "timeout_s='5' is invalid"),
        ({"tests": "assert 1", "prefix": 3}, "'prefix' must be text"),
    ],
)
def test_check_problem_names_the_problem_and_what_is_wrong(meta, says):
    p = make_problem("code", "p", "", meta)
    with pytest.raises(ValueError, match=says) as err:
        CODE.check_problem(p)
    assert p.problem_id in str(err.value)
    with pytest.raises(ValueError, match=says):
        CODE.verify_batch([p], ["print(1)"])  # a data error, not a wrong answer


# ------------------------------------------------------------------ forged rewards

DOUBLE = asserts_problem("def check(candidate):\n    assert candidate(2) == 4\n", "double")
FRAME_WALK = """
import os, sys
def double(x):
    return 0
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_globals.values()) + list(frame.f_locals.values()):
        if isinstance(value, str) and value.startswith("rlax-tests-passed"):
            os.write(1, (value + "\\n").encode())
    frame = frame.f_back
os.write(1, b"rlax-tests-passed\\n")
os._exit(0)
"""
ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
def double(x):
    return Anything()
"""
READS_THE_TESTS = """
import gc, os
NEEDLE = "assert candi" + "date(2) == 4"  # built at run time: not a constant of this text

def seen() -> bool:
    for obj in gc.get_objects():
        values = obj.values() if isinstance(obj, dict) else obj
        if isinstance(obj, (dict, list, tuple)):
            if any(isinstance(v, str) and v is not NEEDLE and NEEDLE in v for v in values):
                return True
    for fd in range(64):
        try:
            if NEEDLE.encode() in os.pread(fd, 1 << 20, 0):
                return True
        except OSError:
            pass
    return False

def double(x):
    return 4 if seen() else 0  # right only for x == 2, and only if the tests were found
"""


@sandboxed
@pytest.mark.parametrize(
    "program",
    [
        FRAME_WALK,
        ALWAYS_EQUAL,
        READS_THE_TESTS,
        "def double(x):\n    return 0\nprint('rlax-tests-passed')",
        "def double(x):\n    return 0\nimport sys\nsys.exit(0)",
        "def double(x):\n    return 0\nimport os\nos._exit(0)",
        # An int subclass equal to everything: not plain data, refused on the way out.
        "class N(int):\n    def __eq__(self, o):\n        return True\n"
        "def double(x):\n    return N(0)",
        # Killing the harness (its parent) or writing a reply frame of its own.
        "import os, signal\ndef double(x):\n    os.kill(os.getppid(), signal.SIGKILL)",
        "import os\nos.write(4, b'\\x00\\x00\\x00\\x0b[\"value\",4]')\n"
        "def double(x):\n    return 0",
    ],
    ids=[
        "frame-walk",
        "always-equal",
        "reads-tests",
        "marker",
        "exit",
        "_exit",
        "int-sub",
        "kill",
        "own-reply",
    ],
)
def test_forged_rewards_score_zero(program):
    # Each forgery also returns a wrong value, so only a forged verdict could pass it; the
    # honest program beside it shows the same problem passes on merit.
    honest = "def double(x):\n    return 2 * x"
    assert CODE.verify_batch([DOUBLE, DOUBLE], [program, honest]) == [0.0, 1.0]


@sandboxed
def test_the_test_reading_probe_finds_tests_that_share_its_process():
    # The control for `reads-tests` above: composed in one process, as before the harness,
    # the probe finds the tests and passes them.
    composed = READS_THE_TESTS + DOUBLE.meta["tests"] + "check(double)\n"
    assert execute(composed).status == "ok"
    assert execute(READS_THE_TESTS + "check = None\nassert double(2) == 0\n").ok


@sandboxed
def test_results_cross_as_plain_data_with_their_exact_types():
    tests = """
def check(candidate):
    assert candidate() == ((1, [2.5, None]), {"a": {3}}, b"x", 1j, frozenset({True}))
    assert type(candidate()[0]) is tuple and candidate()[0] != [1, [2.5, None]]
    assert candidate.__name__ == "values"
"""
    p = asserts_problem(tests, "values")
    right = 'def values():\n    return ((1, [2.5, None]), {"a": {3}}, b"x", 1j, frozenset({True}))'
    as_list = (
        'def values():\n    return [[1, [2.5, None]], {"a": {3}}, b"x", 1j, frozenset({True})]'
    )
    assert CODE.verify_batch([p, p], [right, as_list]) == [1.0, 0.0]


@sandboxed
def test_the_tests_use_the_prefixs_helpers_not_the_programs():
    # HumanEval/32's shape: the test checks the answer with `poly` from the prompt.
    prefix = "def poly(x):\n    return x - 3\n\ndef root():\n    pass\n"
    p = asserts_problem(
        "def check(candidate):\n    assert poly(candidate()) == 0\n", "root", prefix=prefix
    )
    cheat = "def poly(x):\n    return 0\n\ndef root():\n    return 7\n"
    assert CODE.verify_batch([p, p], [cheat, "def root():\n    return 3\n"]) == [0.0, 1.0]
