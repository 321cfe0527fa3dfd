"""Math: free-form final answers (GSM8K, MATH, AIME) judged equal to the gold by math-verify.

`problem.answer` is the gold as the dataset writes it (`72`, `7,425,000`,
`$\\frac{14}{3}$`, `\\boxed{(3, \\frac{\\pi}{2})}`, `28\\%`, intervals, sets, tuples). A
completion's final answer is its last `\\boxed{}` when it has one, else the last
answer-like expression, both as Hugging Face's `math-verify` extracts them; the reward is
1.0 when math-verify finds the two equivalent (numbers up to rounding, fractions, radicals,
sets, intervals, tuples, percentages) and 0.0 otherwise.

Why the sandbox: math-verify parses with sympy, whose `parse_expr` evaluates Python, and
bounds its own work with SIGALRM, which only the main thread may set. So it never runs in
this process (a rollout worker's threads, the host's files): every pair is one run of
`GRADER` in a `pipeline.sandbox` worker that has math-verify and its dependencies bound
read-only (`Limits.packages`) and imported and warmed before its first fork
(`Limits.warmup`), so a run costs a fork and the parse, not an import of sympy. A batch
is one `execute_many` call. This process only does text work: it cuts the completion
down to its last `\\boxed{}` and wraps a bare gold in `$...$` (math-verify reads a bare
`[2, 5)` as 5 and `\\{1,2,3\\}` as 3) unless it is a plain number that wrapping would
misread (`gold_readings`), and `extract_answer` (maj@k's vote) is regex normalisation
(`pipeline.tasks.answers`), no parser. The completion is extracted with math-verify's own
defaults but for the last-boxed rule (`ANSWER_CONFIG`), so an answer that math-verify
accepts (`$\\frac13$`, `$\\sqrt3$`, `$\\frac{1}{3} \\text{meters}$`) is not lost here.

The grader reports on its last line, prefixed with a random nonce sent on its stdin, so
that text the model wrote cannot pass for the verdict by printing; anything else (a crash,
a timeout, the memory cap, no verdict line) scores 0.0. When the sandbox itself cannot run
(`SandboxError`: no bwrap, math-verify missing from the environment) that propagates, as
for the code family: a broken grader must fail the step, not score every sample wrong.

What this does not give: code that sympy evaluates runs inside the grader's process in the
sandbox, so a completion crafted to do so could, in principle, find the nonce in that
process's memory and forge a reward of 1.0 for itself; the host and other runs stay out of
its reach. math-verify's LaTeX path (latex2sympy, an ANTLR parser) evaluates nothing; its
expression path calls `parse_expr` with `evaluate=False`.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Sequence
from typing import ClassVar

from pipeline.sandbox import ExecResult, Job, Limits, execute_many
from pipeline.tasks.answers import canonical_number, extract_math, last_boxed
from pipeline.tasks.base import Problem, Task

# Top-level modules math-verify imports (math-verify, its LaTeX parser, sympy, mpmath and
# the ANTLR runtime latex2sympy's grammar needs).
PACKAGES = ("math_verify", "latex2sympy2_extended", "sympy", "mpmath", "antlr4")
# math-verify's own timeouts (whole seconds, SIGALRM) for each parse and for the
# comparison; the sandbox's wall clock above them catches anything that ignores SIGALRM.
PARSE_TIMEOUT_S = 5
VERIFY_TIMEOUT_S = 5
# A completion without \boxed{}: math-verify reads its tail, where the final answer is; a
# 16k-token ramble is not worth parsing whole.
TAIL_CHARS = 4000
NONCE_BYTES = 16

log = logging.getLogger(__name__)

# Bare golds that `$...$` would make math-verify misread, and how to read each instead
# (see `gold_readings`); anything else bare is wrapped. The patterns follow math-verify's
# plain-number grammar (its thousands groups must start with 1-9).
_BARE_GOLDS = (
    (re.compile(r"-?[1-9]\d{0,2}(?: \d{3})+(?:\.\d+)?"), ("{}",)),
    (re.compile(r"-?\d+,\d+"), ("{}", "${}$")),
)
MAX_GOLD_READINGS = max(len(readings) for _, readings in _BARE_GOLDS)

# The completion's extraction, as source both sandbox programs run: math-verify's own
# defaults (LaTeX with units, malformed operators such as `\frac13` and `\sqrt3`, and
# nits normalised; then plain expressions) except that only the last \boxed{} counts
# (boxed="all", the default, would read two boxed answers as the set of both). Built from
# math-verify's default config rather than a fresh NormalizationConfig, whose own
# defaults switch those normalisations off.
ANSWER_CONFIG = """\
import dataclasses
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
_latex = LatexExtractionConfig()
ANSWER_CONFIG = [
    dataclasses.replace(
        _latex,
        normalization_config=dataclasses.replace(_latex.normalization_config, boxed="last"),
    ),
    ExprExtractionConfig(),
]
"""

# Runs inside the sandbox: stdin carries {"nonce", "golds", "answer"}; `golds` are the
# readings of one gold (see `gold_readings`), and the answer counts when it equals any.
GRADER = (
    """\
import json, os, sys
request = json.loads(sys.stdin.read())
nonce = request.pop("nonce")
"""
    + ANSWER_CONFIG
    + f"""\
golds = [parse(g, parsing_timeout={PARSE_TIMEOUT_S}) for g in request["golds"]]
golds = [g for g in golds if g]
if not golds:
    os.write(1, ("\\n" + nonce + " nogold\\n").encode())
    raise SystemExit(0)
pred = parse(request["answer"], extraction_config=ANSWER_CONFIG, parsing_timeout={PARSE_TIMEOUT_S})
same = bool(pred) and any(verify(g, pred, timeout_seconds={VERIFY_TIMEOUT_S}) for g in golds)
os.write(1, ("\\n" + nonce + (" 1" if same else " 0") + "\\n").encode())
"""
)

# Run once in each worker before it forks runs: the first parse and verify of each kind
# compile regexes and build the ANTLR parser (hundreds of ms); afterwards every run
# inherits them warm.
WARMUP = (
    ANSWER_CONFIG
    + """\
for _g, _p in [("$\\\\frac{14}{3}$", "\\\\boxed{14/3}"), ("$[2, 5)$", "\\\\boxed{[2,5)}"),
               ("$28\\\\%$", "so 0.28"), ("$\\\\{1,2\\\\}$", "\\\\boxed{\\\\{2, 1\\\\}}"),
               ("$(3, \\\\frac{\\\\pi}{2})$", "\\\\boxed{(3, \\\\pi/2)}"), ("$x^2+1$", "1+x**2"),
               ("1,5", "$\\\\frac32 \\\\text{ m}$")]:
    verify(parse(_g), parse(_p, extraction_config=ANSWER_CONFIG))
"""
)

LIMITS = Limits(
    # math-verify's own timeouts for every parse (each reading of the gold, the answer) and
    # every comparison fit inside.
    timeout_s=float(
        (MAX_GOLD_READINGS + 1) * PARSE_TIMEOUT_S + MAX_GOLD_READINGS * VERIFY_TIMEOUT_S
    ),
    memory_mb=1024,  # sympy's import alone is ~150 MB of address space
    output_bytes=64 * 1024,
    packages=PACKAGES,
    warmup=WARMUP,
)


def answer_text(completion: str) -> str:
    """What the grader reads of `completion`: its last `\\boxed{...}` alone when it has
    one (so an earlier boxed draft cannot count), else its tail."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return "\\boxed{" + boxed + "}"
    return completion[-TAIL_CHARS:]


def gold_readings(answer: str) -> tuple[str, ...]:
    """The texts math-verify should read the gold as; an answer equal to any of them counts.

    math-verify extracts LaTeX only between `$...$` or from `\\boxed{}`, and reads a bare
    text with its plain-number grammar, which turns `[2, 5)` into 5. So a bare gold is
    wrapped in `$...$`, except where that wrapping loses what math-verify itself reads:
    a number grouped by spaces (`1 000`, which LaTeX reads as 1*000 = 0) stays bare, and a
    decimal comma (`1,22`) is read both ways, bare as math-verify reads it (1.22) and
    wrapped as the list MATH writes its roots in (`-2,1`: -2 and 1).
    """
    text = answer.strip()
    if "$" in text or "\\boxed" in text:
        return (text,)
    for pattern, readings in _BARE_GOLDS:
        if pattern.fullmatch(text):
            return tuple(reading.format(text) for reading in readings)
    return (f"${text}$",)


def grader_job(problem: Problem, completion: str, nonce: str) -> Job:
    """The sandboxed run that judges one pair."""
    request = {
        "nonce": nonce,
        "golds": list(gold_readings(problem.answer)),
        "answer": answer_text(completion),
    }
    return Job(GRADER, stdin=json.dumps(request), limits=LIMITS)


def verdict(result: ExecResult, nonce: str) -> float:
    """1.0 or 0.0 from the grader's last line; 0.0 when it has none (the run failed)."""
    if result.status != "ok":
        return 0.0
    last = result.stdout.rstrip("\n").rsplit("\n", 1)[-1]
    return 1.0 if last == f"{nonce} 1" else 0.0


class MathTask(Task):
    """Free-form math answers judged by math-verify inside the sandbox."""

    name: ClassVar[str] = "math"

    def extract_answer(self, completion: str) -> str | None:
        """The last boxed answer, cleaned; else the last number; None otherwise."""
        boxed = extract_math(completion)
        if boxed is not None:
            return boxed
        numbers = [canonical_number(w.strip(".,;:!?")) for w in completion.split()[-50:]]
        numbers = [n for n in numbers if n is not None]
        return numbers[-1] if numbers else None

    def verify(self, problem: Problem, completion: str) -> float:
        return self.verify_batch([problem], [completion])[0]

    def verify_batch(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        """Rewards of each pair, all judged in one `execute_many` call. Raises SandboxError
        when the sandbox cannot run (see the module doc)."""
        pairs = list(zip(problems, completions, strict=True))
        nonces = [secrets.token_hex(NONCE_BYTES) for _ in pairs]
        jobs = [grader_job(p, c, n) for (p, c), n in zip(pairs, nonces, strict=True)]
        results = execute_many(jobs)
        for (problem, _), result, nonce in zip(pairs, results, nonces, strict=True):
            if result.stdout.endswith(f"{nonce} nogold\n"):
                # A data error, not the model's: every sample of it scores 0.
                log.warning(
                    "math problem %r: math-verify finds no answer in its gold %r",
                    problem.problem_id,
                    problem.answer,
                )
        return [verdict(r, n) for r, n in zip(results, nonces, strict=True)]

    def check_problem(self, problem: Problem) -> None:
        if not problem.answer.strip():
            raise ValueError(
                f"math problem {problem.problem_id!r} has an empty answer; the math family "
                "needs the gold final answer as the dataset writes it (such as 72 or "
                "$\\frac{14}{3}$)"
            )
