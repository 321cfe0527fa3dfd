"""Code: write a Python program; it is run in the sandbox against the problem's tests.

A problem's `meta` carries its tests in one (or both) of two kinds:

    {"tests": "<python that raises on failure>", "entry_point": "name"}   HumanEval, MBPP
    {"io": [{"stdin": "...", "stdout": "..."}, ...]}                       Codeforces, APPS

plus, optionally, `"prefix"` (the code a completion continues: HumanEval's prompt) and
`"timeout_s"` (per sandboxed run, instead of the kind's default below).

The program (`extract_program`) is the last fenced code block of the completion whose
language tag is python, py, python3 or absent (instruct models often omit the tag); a
completion without any fence is the program itself (a base model continuing the code).
A completion whose fences are all of other languages has no program. An unclosed last
fence runs to the end of the text (generation stopped before the closing fence).

`tests` are graded where the program cannot reach them (`pipeline/tasks/code_harness.py`):
one sandbox run holds two processes, the program's, which runs it and answers calls, and
the harness's, which runs the tests and `check(entry_point)` as HumanEval composes them,
calling the program through proxies whose arguments and results are plain data (JSON of
builtin types). The tests travel in the run's stdin, which the program's process never
sees, and only the harness writes the run's stdout: it passes when that is exactly the
harness's marker line. When the program does not define the entry point, the problem's
`prefix` is put in front of it first, as evalplus and bigcode-evaluation-harness do for
base models: the completion is then the body that continues HumanEval's prompt. The
prefix is also run, trusted, in the harness, so helpers the tests call (`poly`,
`encode_cyclic`) are the dataset's, not the program's. Each `io` case is one run with the
case's stdin; its stdout must equal the expected one up to trailing whitespace on each
line and trailing blank lines (and CRLF), i.e. the usual "ignore trailing whitespace"
judge; line structure and leading spaces still count. A run must exit 0 as well: a
judge calls a non-zero exit a runtime error whatever was printed.

The reward is 1.0 when every run passes, else 0.0 (error, timeout, memory, output cap,
wrong output). All runs of a batch go through one `pipeline.sandbox.execute_many` call so
they overlap. When the sandbox itself cannot run, `SandboxError` propagates: scoring the
batch 0 instead would silently train the policy against a broken grader (every sample
"wrong"), which is far worse than a failed step that the job's retry handles.

What this closes: a program that walks `sys._getframe()` into the harness, prints the
marker, exits early with status 0, or returns an object whose `__eq__` is always true
scores 0 (`tests/pipeline/test_code_task.py::test_forged_rewards_score_zero`): it shares no
process, frame or output stream with the tests, and only plain data crosses. What stays
the test's own business: a test that checks too little (`assert candidate(x)` on any truthy
value) passes a program that exploits that, as anywhere.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from pipeline.sandbox import ExecResult, Job, Limits, execute_many
from pipeline.tasks import code_dsl, code_harness
from pipeline.tasks.base import Problem, SyntheticTask, make_problem

# Per run. HumanEval's evaluator defaults to 3 s per problem; these runs share the CPUs
# with generation on a rollout worker, so twice that. APPS's harness gives an io case 4 s.
TESTS_TIMEOUT_S = 6.0
IO_TIMEOUT_S = 4.0
MAX_TIMEOUT_S = 60.0  # a meta "timeout_s" above this is a data error, not a slow problem
PYTHON_FENCES = frozenset({"python", "py", "python3", ""})

# Used by the curation job (beam_jobs.prompts) and the HumanEval loader alike.
PROMPT_TEMPLATE = (
    "{problem}\n\nWrite your solution in Python and give the complete program in one "
    "```python code block."
)

_OPEN = re.compile(r"([ \t]*)```[ \t]*([A-Za-z0-9_+.#-]*)[^`]*")
_CLOSE = re.compile(r"[ \t]*```[ \t]*")
# The harness (`code_harness`'s module doc) is loaded once per sandbox worker, as the
# module HARNESS_MODULE, by trusted warm-up code, so that a `tests` run compiles one line
# instead of the harness (~2 ms a run).
HARNESS_MODULE = "rlax_code_harness"
HARNESS_WARMUP = f"""\
import sys, types
_module = types.ModuleType({HARNESS_MODULE!r})
exec(compile({Path(code_harness.__file__).read_text()!r}, {HARNESS_MODULE!r}, "exec"),
     _module.__dict__)
sys.modules[{HARNESS_MODULE!r}] = _module
"""
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def render_prompt(problem: str) -> str:
    """The prompt of a code problem whose statement (or function stub) is `problem`."""
    return PROMPT_TEMPLATE.format(problem=problem)


def function_problem(stub: str) -> str:
    """The statement of a complete-this-function problem (HumanEval's prompt `stub`)."""
    return f"Complete the following Python function.\n\n```python\n{stub.rstrip()}\n```"


def _fenced_blocks(text: str) -> list[tuple[str, str]] | None:
    """(language tag, body) of every fenced block in order; None when there is no fence.
    The body loses the fence's own indentation (a fence nested in a list item)."""
    lines = text.splitlines()
    blocks: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        opening = _OPEN.fullmatch(lines[i])
        i += 1
        if opening is None:
            continue
        indent, tag = opening.group(1), opening.group(2).lower()
        body = []
        while i < len(lines) and not _CLOSE.fullmatch(lines[i]):
            body.append(lines[i].removeprefix(indent))
            i += 1
        i += 1  # the closing fence (or past the end when it never came)
        blocks.append((tag, "\n".join(body)))
    return blocks or None


def _tidy(program: str) -> str | None:
    """Trailing spaces and surrounding blank lines dropped, so that programs that differ
    only there vote together (maj@k); leading indentation is kept (a continuation)."""
    lines = [line.rstrip() for line in program.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n" if lines else None


def extract_program(completion: str) -> str | None:
    """The program of a completion (see the module doc), tidied; None when it has none."""
    if not isinstance(completion, str):
        return None
    blocks = _fenced_blocks(completion)
    if blocks is None:
        return _tidy(completion)
    python = [body for tag, body in blocks if tag in PYTHON_FENCES]
    return _tidy(python[-1]) if python else None


def defines(program: str, name: str) -> bool:
    """Whether `program` binds `name` at top level (def, class or assignment). A textual
    check, not `ast`: a continuation body does not parse on its own."""
    pattern = rf"^(?:(?:async[ \t]+)?def|class)[ \t]+{re.escape(name)}\b|^{re.escape(name)}[ \t]*="
    return re.search(pattern, program, re.MULTILINE) is not None


def normalise_output(text: str) -> str:
    """Stdout as the judge compares it: CRLF as LF, no trailing whitespace on any line,
    no trailing blank lines."""
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n")


# ------------------------------------------------------------------ checking problems


def _timeout(problem: Problem, default: float) -> float:
    value = problem.meta.get("timeout_s", default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(
            f"code problem {problem.problem_id}: meta timeout_s={problem.meta['timeout_s']!r} "
            f"is invalid; allowed: a number of seconds in (0, {MAX_TIMEOUT_S:g}]"
        )
    return float(value)


def check_code_problem(problem: Problem) -> None:
    """Raise ValueError naming the problem when its meta has no usable tests."""
    meta, pid = problem.meta, problem.problem_id
    where = f"code problem {pid}"
    if "tests" not in meta and "io" not in meta:
        raise ValueError(
            f"{where} has no tests: meta needs 'tests' (Python that raises on failure, "
            f"optionally with 'entry_point') or 'io' (a list of {{stdin, stdout}} cases); "
            f"it has {sorted(meta)}"
        )
    if "tests" in meta and (not isinstance(meta["tests"], str) or not meta["tests"].strip()):
        raise ValueError(f"{where}: meta 'tests' must be non-empty Python text")
    entry = meta.get("entry_point")
    if entry is not None and not (isinstance(entry, str) and _IDENTIFIER.fullmatch(entry)):
        raise ValueError(f"{where}: meta entry_point={entry!r} is not a Python identifier")
    if entry is not None and "tests" not in meta:
        raise ValueError(f"{where}: meta entry_point is given without 'tests' to check it")
    if "prefix" in meta and not isinstance(meta["prefix"], str):
        raise ValueError(f"{where}: meta 'prefix' must be text (code a completion continues)")
    if "io" in meta:
        cases = meta["io"]
        if not isinstance(cases, list) or not cases:
            raise ValueError(f"{where}: meta 'io' must be a non-empty list of {{stdin, stdout}}")
        for i, case in enumerate(cases):
            if not (
                isinstance(case, Mapping)
                and isinstance(case.get("stdin"), str)
                and isinstance(case.get("stdout"), str)
            ):
                raise ValueError(
                    f"{where}: meta io[{i}] must be an object with text 'stdin' and "
                    f"'stdout'; got {case!r:.80}"
                )
    if "timeout_s" in meta:
        _timeout(problem, TESTS_TIMEOUT_S)


# ------------------------------------------------------------------- runs and scores


@dataclass(frozen=True)
class Check:
    """One sandboxed run of a completion and what its result must show to pass:
    `expect` is the expected normalised stdout (io) or the harness's marker line (tests)."""

    job: Job
    kind: str
    expect: str

    def passes(self, result: ExecResult) -> bool:
        return result.ok and MATCHERS[self.kind](result.stdout, self.expect)


def _reached_end(stdout: str, marker: str) -> bool:
    # Only the harness writes stdout (the program's prints go to stderr).
    return stdout == marker + "\n"


def _same_output(stdout: str, expected: str) -> bool:
    return normalise_output(stdout) == expected


MATCHERS: dict[str, Callable[[str, str], bool]] = {"tests": _reached_end, "io": _same_output}


def program_for(problem: Problem, completion: str) -> str | None:
    """The program to run: the extracted one, behind the problem's `prefix` when it does
    not define the entry point itself (a continuation of the prompt)."""
    program = extract_program(completion)
    if program is None:
        return None
    entry = problem.meta.get("entry_point")
    prefix = problem.meta.get("prefix", "")
    if entry and prefix and not defines(program, entry):
        program = prefix + program
    return program


def tests_job(problem: Problem, program: str) -> Job:
    """The run that grades `program` against the problem's `tests`: the harness's
    `main(program)`, with the tests, entry point and prefix as its stdin."""
    meta = problem.meta
    tests = {k: meta.get(k) for k in ("tests", "entry_point", "prefix")}
    code = f"import {HARNESS_MODULE}\n{HARNESS_MODULE}.main({program!r})\n"
    limits = Limits(timeout_s=_timeout(problem, TESTS_TIMEOUT_S), warmup=HARNESS_WARMUP)
    return Job(code, stdin=json.dumps(tests), limits=limits)


def code_checks(problem: Problem, completion: str) -> list[Check]:
    """The runs that score `completion`; empty when it has no program (reward 0).
    Raises ValueError when the problem itself has no usable tests."""
    check_code_problem(problem)
    program = program_for(problem, completion)
    if program is None:
        return []
    meta = problem.meta
    checks = []
    if "tests" in meta:
        checks.append(Check(tests_job(problem, program), "tests", code_harness.MARKER))
    for case in meta.get("io", ()):
        limits = Limits(timeout_s=_timeout(problem, IO_TIMEOUT_S))
        expected = normalise_output(case["stdout"])
        checks.append(Check(Job(program, stdin=case["stdin"], limits=limits), "io", expected))
    return checks


def score(checks: Sequence[Check], results: Sequence[ExecResult]) -> float:
    """1.0 when there are runs and every one passes, else 0.0."""
    ok = bool(checks) and all(c.passes(r) for c, r in zip(checks, results, strict=True))
    return 1.0 if ok else 0.0


def run_checks(groups: Sequence[Sequence[Check]]) -> list[float]:
    """Score each group of checks, all runs of all groups in one `execute_many` call.
    Raises SandboxError when the sandbox cannot run (see the module doc)."""
    flat = [c.job for group in groups for c in group]
    results = execute_many(flat)
    scores, at = [], 0
    for group in groups:
        scores.append(score(group, results[at : at + len(group)]))
        at += len(group)
    return scores


class CodeTask(SyntheticTask):
    """Python programs scored by sandboxed tests (HumanEval/MBPP asserts or stdin/stdout).

    Problems come from datasets (curated) or from the DSL generator of
    `pipeline.tasks.code_dsl` (`task.code.*`), whose problems carry HumanEval-style tests,
    so one verifier scores both; only generated problems have a teacher (`has_teacher`).
    """

    name: ClassVar[str] = "code"
    Options: ClassVar[type] = code_dsl.CodeOptions
    NOISE_FIELDS = ("error_prob",)

    def sample_problem(self, rng: np.random.Generator, options: code_dsl.CodeOptions) -> Problem:
        program, shown, hidden = code_dsl.sample(rng, options)
        meta = {
            "tests": code_dsl.tests_text(program, hidden),
            "entry_point": code_dsl.ENTRY_POINT,
            "prefix": code_dsl.HEADER,
            "program": [list(op) for op in program],
            "hidden": hidden,
        }
        prompt = code_dsl.prompt_text(program, shown)
        return make_problem(self.name, prompt, code_dsl.render(program), meta)

    def has_teacher(self, problem: Problem) -> bool:
        return "program" in problem.meta

    def teacher_solution(
        self, problem: Problem, rng: np.random.Generator, options: code_dsl.CodeOptions
    ) -> str:
        if not self.has_teacher(problem):
            raise ValueError(
                f"code problem {problem.problem_id} comes from a dataset and has no teacher: "
                "only problems of the DSL generator (meta 'program') can be demonstrated"
            )
        program = code_dsl.parse_program(problem.meta["program"])
        wrong = code_dsl.teacher_program(program, problem.meta["hidden"], rng, options)
        return code_dsl.render(wrong)

    def max_completion_chars(self, options: code_dsl.CodeOptions) -> int:
        return code_dsl.max_render_chars(options)

    def extract_answer(self, completion: str) -> str | None:
        return extract_program(completion)

    def verify(self, problem: Problem, completion: str) -> float:
        return self.verify_batch([problem], [completion])[0]

    def verify_batch(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        """Rewards of each pair; unlike other families this raises SandboxError when the
        sandbox cannot run, and ValueError for a problem `check_problem` refuses."""
        groups = [code_checks(p, c) for p, c in zip(problems, completions, strict=True)]
        return run_checks(groups)

    def check_problem(self, problem: Problem) -> None:
        check_code_problem(problem)
