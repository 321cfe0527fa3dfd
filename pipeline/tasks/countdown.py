"""Countdown: combine the given numbers with + - * / (each exactly once) to hit a target.

Prompt: the numbers in ascending order, comma-separated, then " to " and the target:

    3,7,12 to 33:

Completion: the evaluation steps of the expression in post-order, comma-separated, then
the answer marker and the expression (fewest parentheses):

    3*7=21,21+12=33#3*7+12

Generation: numbers are drawn from 1..20 (one of them from 21..50 a quarter of the time);
the target comes from combining two random pool values at a time, as in the game, with
every intermediate result a positive integer <= `MAX_VALUE` (so a solution exists and the
teacher's steps never show fractions). The canonical text of that expression is the
reference answer; the verifier accepts any expression that uses the given multiset of
numbers exactly and equals the target, evaluated exactly with fractions.

Teacher mistake (probability `sft.countdown_error_prob`): a systematic slip in the last
step, whose operator is replaced (+ -> -, - -> +, * -> +, / -> -; the next in
`SLIP_ORDER` if that happens to give the same value). The slipped step's arithmetic and
the final expression follow the slip, so the teacher's answer is always wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import numpy as np

from pipeline.errors import check
from pipeline.tasks import expr
from pipeline.tasks.base import ANSWER_MARKER, Problem, SyntheticTask, final_answer, make_problem

SMALL = (1, 20)
LARGE = (21, 50)
LARGE_PROB = 0.25
MAX_VALUE = 999  # every intermediate and the target lie in 1..MAX_VALUE
OP_WEIGHTS = {"+": 0.3, "-": 0.25, "*": 0.3, "/": 0.15}
SLIP_ORDER = {"+": "-+", "-": "+-", "*": "+-", "/": "-+"}
STEP_SEP = ","
MAX_TRIES = 1000


def _combine(a: int, b: int, op: str) -> int | None:
    """Result of `a op b` if it is a positive integer <= MAX_VALUE and not trivial."""
    if op == "+":
        r = a + b
    elif op == "-":
        r = a - b
    elif op == "*":
        r = a * b if min(a, b) > 1 else 0  # x*1 teaches nothing
    else:
        r = a // b if b > 1 and a % b == 0 else 0
    return r if 0 < r <= MAX_VALUE else None


def random_expression(rng: np.random.Generator, nums: list[int]) -> expr.Node | None:
    """Combine two random pool entries at a time until one expression remains."""
    pool: list[tuple[int, expr.Node]] = [(n, expr.Num(n)) for n in nums]
    ops = list(OP_WEIGHTS)
    weights = np.array([OP_WEIGHTS[o] for o in ops])
    while len(pool) > 1:
        i, j = rng.choice(len(pool), size=2, replace=False)
        (a, na), (b, nb) = pool[i], pool[j]
        if a < b:  # larger first keeps '-' and '/' positive
            (a, na), (b, nb) = (b, nb), (a, na)
        results = [_combine(a, b, o) for o in ops]
        ok = np.array([r is not None for r in results])
        if not ok.any():
            return None
        p = np.where(ok, weights, 0.0)
        k = int(rng.choice(len(ops), p=p / p.sum()))
        node = expr.BinOp(ops[k], na, nb)
        pool = [e for t, e in enumerate(pool) if t not in (i, j)] + [(results[k], node)]
    return pool[0][1]


def _steps_ok(node: expr.Node) -> bool:
    return all(r.denominator == 1 and 0 < r <= MAX_VALUE for _, _, _, r in expr.steps(node))


def _step_text(a: Fraction, op: str, b: Fraction, r: Fraction) -> str:
    return f"{expr.fmt_value(a)}{op}{expr.fmt_value(b)}={expr.fmt_value(r)}"


def slip(node: expr.BinOp) -> expr.BinOp:
    """The teacher's mistake: the root (last step) uses another op, changing the value."""
    right_value = expr.evaluate(node)
    for op in SLIP_ORDER[node.op]:
        wrong = expr.BinOp(op, node.left, node.right)
        if expr.evaluate(wrong) != right_value:
            return wrong
    raise AssertionError(f"no slip changes the value of {expr.to_str(node)}")  # unreachable


def solution_text(node: expr.BinOp) -> str:
    steps = STEP_SEP.join(_step_text(*s) for s in expr.steps(node))
    return f"{steps}{ANSWER_MARKER}{expr.to_str(node)}"


@dataclass(frozen=True)
class CountdownOptions:
    """`task.countdown.*`: how many numbers a problem gives, and how often the teacher's
    final step is wrong."""

    numbers: int = 3
    error_prob: float = 0.3

    def __post_init__(self) -> None:
        check(2 <= self.numbers <= 5, "task.countdown.numbers", self.numbers, "2..5")
        check(0 <= self.error_prob < 1, "task.countdown.error_prob", self.error_prob, "[0, 1)")


class CountdownTask(SyntheticTask):
    name = "countdown"
    Options: ClassVar[type] = CountdownOptions
    NOISE_FIELDS = ("error_prob",)

    def sample_problem(self, rng: np.random.Generator, cfg: CountdownOptions) -> Problem:
        k = cfg.numbers
        for _ in range(MAX_TRIES):
            nums = [int(x) for x in rng.integers(SMALL[0], SMALL[1] + 1, size=k)]
            if rng.random() < LARGE_PROB:
                nums[int(rng.integers(k))] = int(rng.integers(LARGE[0], LARGE[1] + 1))
            node = random_expression(rng, nums)
            if node is None:
                continue
            # Steps and checks follow the canonical text, as the teacher writes it.
            canon = expr.to_str(node)
            tree = expr.parse(canon)
            if not _steps_ok(tree):
                continue
            return self.make(nums, canon)
        raise RuntimeError(f"no countdown problem with {k} numbers found in {MAX_TRIES} tries")

    def make(self, numbers: list[int], solution: str) -> Problem:
        """The problem solved by the expression `solution` over exactly `numbers`."""
        tree = expr.parse(solution)
        nums = sorted(int(n) for n in numbers)
        value = expr.evaluate(tree)
        if sorted(expr.numbers(tree)) != nums or value.denominator != 1 or value <= 0:
            raise ValueError(
                f"solution {solution!r} must use exactly {nums} and give a "
                f"positive integer; it uses {sorted(expr.numbers(tree))} = {value}"
            )
        target = int(value)
        prompt = f"{','.join(map(str, nums))} to {target}:"
        return make_problem(self.name, prompt, solution, {"numbers": nums, "target": target})

    def teacher_solution(
        self, problem: Problem, rng: np.random.Generator, options: CountdownOptions
    ) -> str:
        tree = expr.parse(problem.answer)
        if not isinstance(tree, expr.BinOp):  # one number: nothing to compute
            return f"{ANSWER_MARKER}{problem.answer}"
        if rng.random() < options.error_prob:
            tree = slip(tree)
        return solution_text(tree)

    def extract_answer(self, completion: str) -> str | None:
        return final_answer(completion, expr.MAX_EXPR_CHARS)

    def verify(self, problem: Problem, completion: str) -> float:
        text = self.extract_answer(completion)
        if not text:
            return 0.0
        try:
            tree = expr.parse(text)
            value = expr.evaluate(tree)
        except (ValueError, ArithmeticError, RecursionError):
            return 0.0
        used = sorted(expr.numbers(tree))
        ok = used == sorted(problem.meta["numbers"]) and value == problem.meta["target"]
        return 1.0 if ok else 0.0

    def max_completion_chars(self, cfg: CountdownOptions) -> int:
        k = cfg.numbers
        w = len(str(MAX_VALUE))
        # k-1 steps "a op b=r," (the slipped result may reach 2*MAX_VALUE or go negative),
        # the marker, then k numbers of <= 2 digits, k-1 ops and <= k-2 pairs of parentheses.
        step = w + 1 + w + 1 + (w + 1) + 1
        return (k - 1) * step + 1 + 2 * k + (k - 1) + 2 * max(k - 2, 0)
