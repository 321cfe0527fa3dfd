"""Math verification throughput (named so, not math_verify.py, which would shadow the package): the math family's sandboxed math-verify against math-verify
called in this process (unsafe for model text: the ceiling), in the same run.

* sandboxed (MathTask.verify_batch): one fork of a warm sandbox worker per pair, math-verify
  and sympy imported and warmed in the worker beforehand; a batch is one execute_many.
* in-process math-verify (unsafe ceiling): parse + verify in this process's main thread,
  serially (its SIGALRM timeouts allow nothing else), on the same pairs.

The pairs are GSM8K, MATH and AIME answer forms, each with an equivalent and a wrong
completion; every verdict is checked in both modes.

Then agreement: on DOCUMENTED, answers written as models write them and cases built from
math-verify's documented behaviour, each with a verdict worked by hand, the share of cases
where the math family and math-verify called directly (its defaults) give that verdict.

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


# (what it exercises, gold, completion, verdict worked by hand). Written for this benchmark
# from math-verify's documented behaviour (the docstrings and comments of its parser and of
# latex2sympy2_extended's NormalizationConfig), not copied from its tests.
DOCUMENTED = [
    # Plain numbers: thousands by comma or space, decimal point or comma, a leading-dot
    # decimal, a currency sign; no number is read out of a word.
    ("number", "8200", "It costs 8,200 dollars", 1),
    ("number", "8200", "It costs 8 200", 1),
    ("number", "4 096", "\\boxed{4096}", 1),
    ("number", "4 096", "\\boxed{100}", 0),  # what `$4 096$` reads as in LaTeX
    ("number", "2.5", "so it is 2,5", 1),
    ("number", "3,75", "\\boxed{3.75}", 1),
    ("number", "3,75", "\\boxed{375}", 0),
    ("number", "0,25", "The result is 0.25.", 1),
    ("number", "0.75", "the share is .75", 1),
    ("number", "1250.5", "She paid $1,250.50", 1),
    ("number", "40", "It costs €40", 1),
    ("number", "7", "the code is XK7Z", 0),
    ("number", "-12", "so x = -12", 1),
    ("number", "-12", "so x = 12", 0),
    # LaTeX environments: inline $...$ and \(...\) on one line, display $$...$$ and \[...\]
    # on several.
    ("environment", "$y^3$", "so we get $y^3$", 1),
    ("environment", "$y^3$", "so we get \\(y^3\\)", 1),
    ("environment", "$y^3$", "we get $$\ny^3\n$$", 1),
    ("environment", "$y^3$", "we get \\[\ny^3\n\\]", 1),
    ("environment", "$y^3$", "we get $\ny^3\n$", 0),
    ("environment", "$y^3$", "we get \\(\ny^3\n\\)", 0),
    ("environment", "$12$", "we get $\n12\n$", 1),  # the plain-number reading still sees 12
    # Malformed operators and \frac variants.
    ("operator", "$\\frac{2}{7}$", "it is $\\frac27 $", 1),
    ("operator", "$\\frac{7}{2}$", "it is $\\frac27 $", 0),
    ("operator", "$1/2$", "$\\frac4{8} $", 1),
    ("operator", "$\\sqrt{5}$", "$\\sqrt5 $", 1),
    ("operator", "$\\sqrt{6}$", "$\\sqrt5 $", 0),
    ("operator", "$2\\sqrt{2}$", "\\boxed{2\\sqrt2}", 1),
    ("operator", "$\\frac{1}{9}$", "\\boxed{\\frac19}", 1),
    ("operator", "$9$", "\\boxed{\\frac19}", 0),
    ("operator", "$\\frac{3}{4}$", "\\boxed{\\dfrac34}", 1),
    ("operator", "$\\frac{3}{4}$", "\\boxed{\\cfrac{3}{4}}", 1),
    ("operator", "$\\frac{3}{4}$", "$\\left( \\tfrac{3}{4} \\right)$", 1),
    # Units after the value.
    ("unit", "5/2", "The rod is $\\frac{5}{2} \\text{centimeters}$", 1),
    ("unit", "2/5", "The rod is $\\frac{5}{2} \\text{centimeters}$", 0),
    ("unit", "$12$", "\\boxed{12 \\text{ meters}}", 1),
    ("unit", "$13$", "\\boxed{12 \\text{ meters}}", 0),
    ("unit", "$8$", "\\boxed{8 \\textbf{ kg}}", 1),
    ("unit", "$60$", "the speed is $60 \\text{mph}$", 1),
    # Percentages.
    ("percent", "$15\\%$", "15 percent", 1),
    ("percent", "$15\\%$", "\\boxed{15\\%}", 1),
    ("percent", "$15\\%$", "$15$ pct", 1),
    ("percent", "$15\\%$", "\\boxed{15}", 1),
    ("percent", "$15\\%$", "\\boxed{16\\%}", 0),
    ("percent", "$0.15$", "15", 0),
    ("percent", "$15$", "15/100", 0),
    # Boxed answers, nested braces, the last of several.
    ("boxed", "$\\frac{\\sqrt{2}}{2}$", "thus \\boxed{\\frac{\\sqrt{2}}{2}}.", 1),
    ("boxed", "$\\frac{\\sqrt{2}}{2}$", "thus \\boxed{\\frac{\\sqrt{3}}{2}}.", 0),
    (
        "boxed",
        "$6$",
        "First \\boxed{5}; " + "that was wrong, I dropped a term. " * 3 + "So \\boxed{6}",
        1,
    ),
    ("boxed", "$6$", "\\boxed{5}, \\boxed{6}", 0),  # adjacent boxes: one answer, the set {5, 6}
    ("boxed", "$6$", "$\\boxed{6}$", 1),
    # Anchors and equations: "final answer is", "answer:", the last `=`.
    ("anchor", "$42$", "Final Answer: The final answer is $42$. I hope it is correct.", 1),
    ("anchor", "$42$", "Answer: 42", 1),
    ("anchor", "$42$", "The answer is 41.", 0),
    ("anchor", "$x+1$", "answer: $x + 1$", 1),
    ("anchor", "$\\frac{1}{3}$", "$k = \\frac{1}{3}$", 1),
    ("anchor", "$5$", "$x = 2 + 3 = 5$", 1),
    ("anchor", "$5$", "$x = 5 + 1 = 6$", 0),
    # Intervals, sets, tuples, lists.
    ("set", "$[1,4)$", "\\boxed{[1, 4)}", 1),
    ("set", "$[1,4)$", "\\boxed{(1,4)}", 0),
    ("set", "$(-\\infty, 0)$", "\\boxed{(-\\infty,0)}", 1),
    ("set", "\\{2,5\\}", "\\boxed{\\{5,2\\}}", 1),
    ("set", "(2,5)", "\\boxed{(5,2)}", 0),
    ("set", "-3,4", "the roots are \\boxed{4, -3}", 1),  # MATH's list of roots
    ("set", "-3,4", "\\boxed{-3}", 0),
    # Expressions, text, matrices.
    ("expression", "$x^2+2x$", "\\boxed{x(x+2)}", 1),
    ("expression", "$x^2+2x$", "\\boxed{x(x-2)}", 0),
    ("expression", "3/2", "it is 1 + 1/2", 1),
    ("expression", "$\\text{Evelyn}$", "\\boxed{\\text{Evelyn}}", 1),
    ("expression", "$\\text{Evelyn}$", "\\boxed{\\text{Briana}}", 0),
    (
        "expression",
        "$\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}$",
        "\\boxed{\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}}",
        1,
    ),
    (
        "expression",
        "$\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}$",
        "\\boxed{\\begin{pmatrix} 2 & 1 \\\\ 3 & 4 \\end{pmatrix}}",
        0,
    ),
    # No answer at all.
    ("none", "$3$", "I cannot solve this.", 0),
    ("none", "$3$", "", 0),
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


def agreement() -> dict[str, list[float]]:
    """Verdicts of the math family (sandboxed) and of math-verify called directly with its
    defaults (`verify(parse(gold), parse(completion))`, in this process: fixed, trusted text)
    on DOCUMENTED."""
    from math_verify import parse, verify

    problems = [
        Problem(problem_id=f"d{i}", task="math", prompt="q", answer=gold, meta={})
        for i, (_, gold, _, _) in enumerate(DOCUMENTED)
    ]
    family = math_task.MathTask().verify_batch(problems, [c for _, _, c, _ in DOCUMENTED])
    direct = [float(verify(parse(g), parse(c))) for _, g, c, _ in DOCUMENTED]
    return {"math family (MathTask.verify_batch)": family, "math-verify direct (defaults)": direct}


def agreement_lines(verdicts: dict[str, list[float]]) -> list[str]:
    want = [float(w) for *_, w in DOCUMENTED]
    lines = [
        "| mode | agrees with the hand verdict | accepts a wrong answer | rejects a right one |",
        "|---|---:|---:|---:|",
    ]
    for name, got in verdicts.items():
        pairs = list(zip(got, want, strict=True))
        agree = sum(g == w for g, w in pairs)
        false_accept = sum(g > w for g, w in pairs)
        false_reject = sum(g < w for g, w in pairs)
        lines.append(
            f"| {name} | {agree}/{len(want)} ({100 * agree / len(want):.0f}%) "
            f"| {false_accept} | {false_reject} |"
        )
    lines += ["", "Cases where a mode and the hand verdict differ:", ""]
    lines += ["| form | gold | completion | hand | " + " | ".join(verdicts) + " |"]
    lines += ["|---|---|---|---:|" + "---:|" * len(verdicts)]
    for i, (form, gold, completion, w) in enumerate(DOCUMENTED):
        got = [v[i] for v in verdicts.values()]
        if any(g != w for g in got):
            cells = [form, f"`{gold}`", f"`{completion}`".replace("\n", " ").replace("|", "\\|")]
            lines.append(
                "| " + " | ".join(cells) + f" | {w} | " + " | ".join(f"{g:.0f}" for g in got) + " |"
            )
    return lines


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
    lines += [
        "# Agreement with math-verify's documented behaviour",
        "",
        f"The same run, on DOCUMENTED: {len(DOCUMENTED)} (gold, completion) cases written for "
        "this benchmark from math-verify's documented behaviour (its parser's and "
        "latex2sympy2_extended's NormalizationConfig's docstrings and comments: number "
        "grammar, LaTeX environments, malformed operators, units, percentages, boxed answers, "
        "anchors, sets, expressions), each with its verdict worked by hand. math-verify direct "
        "is `verify(parse(gold), parse(completion))` with math-verify's defaults.",
        "",
        *agreement_lines(agreement()),
        "",
        "Where the two differ by design: the family reads only the last `\\boxed{}` (an "
        "earlier boxed draft never counts), where math-verify reads adjacent boxes as one set; "
        "and it reads a bare gold as LaTeX (`$...$`) unless it is a plain number, where "
        "math-verify's number grammar reads `\\{2,5\\}` as 5 and a root list `-3,4` as -3.4 "
        "(the family reads a decimal comma both ways: `3,75` is 3.75 or the list 3, 75).",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
