"""Math verification throughput (named so, not math_verify.py, which would shadow the package): the math family's sandboxed math-verify against math-verify
called in this process (unsafe for model text: the ceiling), in the same run.

* sandboxed (MathTask.verify_batch): one fork of a warm sandbox worker per pair, math-verify
  and sympy imported and warmed in the worker beforehand; a batch is one execute_many.
* in-process math-verify (unsafe ceiling): parse + verify in this process's main thread,
  serially (its SIGALRM timeouts allow nothing else), on the same pairs.

The pairs are GSM8K, MATH and AIME answer forms, each with an equivalent and a wrong
completion; every verdict is checked in both modes.

    .venv/bin/python benchmarks/math_verification.py [--pairs 512] [--batch 256]

Writes the table to benchmarks/results/math_verification.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.sandbox.pool import pool_for  # noqa: E402
from pipeline.tasks import math_task  # noqa: E402
from pipeline.tasks.base import Problem  # noqa: E402

# (gold, equivalent completion, wrong completion) templates; `{k}` makes every pair
# distinct, so neither mode profits from sympy's caches across repeats of one pair.
CASES = [
    ("{k}", "She sold 48 + {k} - 48 = {k} clips, so \\boxed{{{k}}}.", "\\boxed{{{k1}}}"),
    ("{k},425,000", "The total is \\boxed{{{k}425000}}", "\\boxed{{{k}42500}}"),
    ("$\\frac{{{k}}}{{3}}$", "Hence $x = \\boxed{{\\dfrac{{{k}}}{{3}}}}$.", "\\boxed{{{k}.3}}"),
    (
        "\\boxed{{({k}, \\frac{{\\pi}}{{2}})}}",
        "\\boxed{{\\left({k}, \\frac{{\\pi}}{{2}}\\right)}}",
        "\\boxed{{({k}, \\pi)}}",
    ),
    ("{k}\\%", "\\boxed{{{k}\\%}}", "\\boxed{{{k1}\\%}}"),
    ("[2, {k})", "so the range is \\boxed{{[2,{k})}}", "\\boxed{{(2, {k})}}"),
    ("\\{{1,2,{k}\\}}", "\\boxed{{\\{{{k}, 2, 1\\}}}}", "\\boxed{{\\{{1, {k}\\}}}}"),
    ("x^2+{k}", "\\boxed{{{k} + x^2}}", "\\boxed{{x^2 - {k}}}"),
]


def pairs(n: int) -> tuple[list[Problem], list[str], list[float]]:
    problems, completions, want = [], [], []
    for i in range(n):
        gold, right, wrong = CASES[(i // 2) % len(CASES)]
        k = {"k": 10 + i // (2 * len(CASES)), "k1": 11 + i // (2 * len(CASES))}
        gold, completion = gold.format(**k), (right if i % 2 == 0 else wrong).format(**k)
        problems.append(Problem(problem_id=str(i), task="math", prompt="q", answer=gold, meta={}))
        completions.append(completion)
        want.append(1.0 if i % 2 == 0 else 0.0)
    return problems, completions, want


def sandboxed(problems: list[Problem], completions: list[str], batch: int) -> list[float]:
    task = math_task.MathTask()
    out: list[float] = []
    for at in range(0, len(problems), batch):
        out += task.verify_batch(problems[at : at + batch], completions[at : at + batch])
    return out


def in_process(problems: list[Problem], completions: list[str]) -> list[float]:
    # Trusted, fixed inputs only: this is what the math family must never do with model text.
    # The grader's own extraction config and gold readings, so both modes judge alike.
    scope: dict = {}
    exec(math_task.ANSWER_CONFIG, scope)
    parse, verify, config = scope["parse"], scope["verify"], scope["ANSWER_CONFIG"]
    out = []
    for p, c in zip(problems, completions, strict=True):
        golds = [parse(g) for g in math_task.gold_readings(p.answer)]
        pred = parse(math_task.answer_text(c), extraction_config=config)
        out.append(1.0 if pred and any(g and verify(g, pred) for g in golds) else 0.0)
    return out


def timed(fn, want: list[float]) -> float:
    start = time.perf_counter()
    got = fn()
    elapsed = time.perf_counter() - start
    if got != want:
        bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
        raise AssertionError(f"wrong verdicts at {bad[:10]}")
    return len(want) / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256, help="pairs per verify_batch call")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/math_verification.md"))
    args = parser.parse_args(argv)

    problems, completions, want = pairs(args.pairs)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    pool_for(math_task.LIMITS).warm()
    warm_s = time.perf_counter() - start
    size = pool_for(math_task.LIMITS).size
    warm_n = 2 * len(CASES)
    sandboxed(problems[:warm_n], completions[:warm_n], args.batch)  # untimed
    in_process(problems[:warm_n], completions[:warm_n])
    rates = {
        "sandboxed (MathTask.verify_batch)": timed(
            lambda: sandboxed(problems, completions, args.batch), want
        ),
        "in-process math-verify (unsafe ceiling)": timed(
            lambda: in_process(problems, completions), want
        ),
    }
    ceiling = rates["in-process math-verify (unsafe ceiling)"]
    lines = [
        "# Math verification throughput",
        "",
        f"`python benchmarks/math_verification.py --pairs {args.pairs} --batch {args.batch}` on "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}. "
        f"{args.pairs} distinct (gold, completion) pairs over {len(CASES)} answer forms, "
        f"half equivalent and half wrong, every verdict checked. Starting the pool ({size} "
        f"workers, math-verify and sympy imported and warmed in each) took {warm_s:.2f} s, "
        f"not counted. 1-minute load average before the run: {load_before:.2f}.",
        "",
        "| mode | pairs/s | vs in-process |",
        "|---|---:|---:|",
    ]
    for name, rate in rates.items():
        lines.append(f"| {name} | {rate:.1f} | {rate / ceiling:.2f}x |")
    lines += [
        "",
        "A rollout step of 32 prompts x 8 samples is 256 pairs. The in-process row uses one "
        "core (math-verify's SIGALRM timeouts need the main thread); the sandboxed row "
        "forks one run per pair on every worker, each isolated as docs/security.md says.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
