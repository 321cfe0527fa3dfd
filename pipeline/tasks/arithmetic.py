"""Arithmetic: multi-digit addition and multiplication by one digit, worked column by column.

Formats for 4567+123 and 4567*8 with max_digits = 6 (the answer marker is '#'):

    prompt      d4c5b6a7+c1b2a3=
    completion  a7+3+0=10     b6+2+1=090    c5+1+0=0690   d4+0+0=04690  # 4690

    prompt      d4c5b6a7*8=
    completion  a7*8+0=56     b6*8+5=536    c5*8+5=4536   d4*8+4=36536  #36536

The prompt tags every digit of a multi-digit operand with its place: 'a' for units, 'b'
for tens, ... One step per column, least significant first, each exactly 8 + W characters
where W = `meta["width"]` (the config's max_digits when the problem was drawn): the place
letter, the column's digits (the shorter addend padded with 0; the multiplier), '+' the
carry-in, '=' the carry-out, then the running result, i.e. the result digits found so far,
most significant first (this column's digit, then the previous step's running result),
left-aligned in W characters. The answer is the last carry-out (a space when it is 0)
followed by the final running result; the verifier strips the space.

Why this format. The key requirement is learnability by a ~0.6M-parameter, 3-layer
char-level transformer in a few hundred SFT steps, so every character is a function of
few characters found either by content or at one fixed distance:
- operand digits are found by content: the step's place letter matches the prompt's tag
  (the letter itself is the previous step's letter + 1, a fixed 8+W characters back);
- the carry-in is the carry-out of the previous step, a fixed 6+W characters back;
- the carry-out and the new digit depend only on the three digits just written;
- the rest of the running result is a copy of the previous one shifted by one place,
  a fixed 9+W characters back, and the answer copies the last running result at a fixed
  distance. Without it the answer must reverse the order of the step digits, which needs
  a distance that grows with the digit index; in scratch runs that reversal was the last
  thing the model learned;
- every step has the same width, so all of those distances are the same in all
  problems of a run.
Scratch runs: the demo model (3 layers, 128 wide) SFT'd for 600 steps of 64 with the
default optimiser on the default mix and noisy teacher, scored on the 500 default eval
problems by the probability of writing the exact correct chain (an ideal imitator of the
teacher: 0.125 for additions, 0.085 for multiplications) and by greedy decoding:
    untagged prompt, answer reversed from the step digits:  add 0.029 / 38%, mul 0.000 / 0%
    tagged prompt, answer reversed from the step digits:    add 0.083 / 70%, mul 0.001 / 2%
    tagged prompt, running result (this format):           add 0.070 / 60%, mul 0.013 / 15%
(with the running result the answer digits were wrong 1-5% of the time against 7-36%
with the reversal; greedy decoding also flips on the teacher's 60/40 carry coin, so it is
noisy). Multiplication, a 720-entry table x*m+c, is the slowest part to learn; more SFT
steps help. The cost is length: W*(8+W) + W + 2 characters at most, 92 at max_digits = 6
(the sampler must allow one more token for EOS).

Teacher mistake (systematic): whenever a column's carry-out is non-zero, it is dropped
with probability `sft.carry_drop_prob`: the next step adds carry 0 (or, for the last
column, the answer gets no leading carry digit). Later steps stay consistent with the
dropped carry, so the answer is wrong by exactly the dropped carries, and the teacher is
right with probability (1 - p)^K, K = the number of non-zero carry-outs of the correct
computation (`meta["carries"]`).

Sampling makes carries common (problems with many carries are the ones a teacher
imitator rarely solves, even with 8 samples): digit d has weight (d+1)^2, the leading
digit is non-zero, an operand of length L in [min_digits, max_digits] has weight
(L - min_digits + 1)^2, multipliers 2..9 have weight m^2, and 70% of problems are
additions. With the default TaskConfig and p = 0.4 this gives E[K] = 4.7, a teacher
accuracy of 0.11 and a perfect imitator's pass@8 of 0.54 on arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from pipeline.errors import check
from pipeline.tasks.base import (
    ANSWER_MARKER,
    Problem,
    SyntheticTask,
    final_answer,
    integer_reward,
    make_problem,
)

ADD_FRACTION = 0.7
DIGIT_WEIGHTS = np.arange(1, 11, dtype=np.float64) ** 2  # digit d -> (d+1)^2
MULTIPLIERS = np.arange(2, 10)
MULTIPLIER_WEIGHTS = MULTIPLIERS.astype(np.float64) ** 2
PLACES = "abcdefghijklmnopqrstuvwxyz"  # place tags: a = units, b = tens, ...
MAX_ANSWER_CHARS = 64

Column = tuple[int, int, int, int, int]  # (x, y, carry_in, carry_out, digit)


def _cdf(w: np.ndarray) -> np.ndarray:
    c = np.cumsum(w, dtype=np.float64)
    return c / c[-1]


def draw(rng: np.random.Generator, cdf: np.ndarray, size: int | None = None) -> np.ndarray:
    """Indices drawn with probabilities given by `cdf` (faster than rng.choice(p=...))."""
    return np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), len(cdf) - 1)


_DIGIT_CDF = _cdf(DIGIT_WEIGHTS)
_LEAD_CDF = _cdf(DIGIT_WEIGHTS[1:])
_MULT_CDF = _cdf(MULTIPLIER_WEIGHTS)


def sample_operand(rng: np.random.Generator, cfg: ArithmeticOptions) -> int:
    """Length L in [min_digits, max_digits] with weight (L - min_digits + 1)^2, a non-zero
    leading digit, digits d with weight (d+1)^2."""
    span = cfg.max_digits - cfg.min_digits + 1
    length = cfg.min_digits + int(draw(rng, _cdf(np.arange(1.0, span + 1) ** 2)))
    digits = draw(rng, _DIGIT_CDF, length)
    digits[0] = 1 + draw(rng, _LEAD_CDF)
    return int("".join(map(str, digits)))


def column_count(op: str, a: int, b: int) -> int:
    """Column steps of `a op b`: the longer addend's digits, or the multiplicand's."""
    return len(str(max(a, b))) if op == "+" else len(str(a))


def columns(op: str, a: int, b: int, drop: np.ndarray | None = None) -> tuple[list[Column], int]:
    """The column steps and the final carry.

    `drop[i]` True drops column i's carry-out (the teacher's mistake); the steps after it
    are computed from the dropped carry. None: the correct computation.
    """
    xs = str(a)[::-1]
    if op == "+":
        ys = str(b)[::-1]
        n = max(len(xs), len(ys))
        xs, ys = xs.ljust(n, "0"), ys.ljust(n, "0")
    else:
        n = len(xs)
        ys = str(b) * n
    steps: list[Column] = []
    carry = 0
    for i in range(n):
        x, y = int(xs[i]), int(ys[i])
        t, u = divmod((x + y if op == "+" else x * y) + carry, 10)
        steps.append((x, y, carry, t, u))
        carry = 0 if drop is not None and drop[i] else t
    return steps, carry


# A slip of the worked computation (`slipped_columns`): what a sampling policy gets wrong
# at one column, the rest of the chain carried on from it as the policy does.
SLIPS = ("operand", "digit", "carry", "answer")


def slipped_columns(
    op: str, a: int, b: int, at: int, kind: str, delta: int
) -> tuple[list[Column], int]:
    """The column steps and final carry with one slip at column `at` (`kind`, one of SLIPS
    but "answer"): its first operand digit ("operand") or result digit ("digit") is off by
    `delta` (1..9, mod 10), or its carry-out ("carry") is off by `delta` (mod 2 for '+',
    mod 9 for '*', whose carries are 0..8). Later columns add the slipped carry."""
    steps, _ = columns(op, a, b)
    out: list[Column] = []
    carry = 0
    for i, (x, y, _, _, _) in enumerate(steps):
        if i == at and kind == "operand":
            x = (x + delta) % 10
        t, u = divmod((x + y if op == "+" else x * y) + carry, 10)
        if i == at and kind == "digit":
            u = (u + delta) % 10
        if i == at and kind == "carry":
            t = (t + delta) % (2 if op == "+" else 9)
        out.append((x, y, carry, t, u))
        carry = t
    return out, carry


def count_carries(op: str, a: int, b: int) -> int:
    """Non-zero carry-outs of the correct computation (the last column's included)."""
    steps, _ = columns(op, a, b)
    return sum(1 for s in steps if s[3] > 0)


def tag(number: int) -> str:
    """Digits tagged with their place, most significant first: 4567 -> 'd4c5b6a7'."""
    digits = str(number)
    n = len(digits)
    return "".join(PLACES[n - 1 - k] + d for k, d in enumerate(digits))


def prompt_text(op: str, a: int, b: int) -> str:
    return f"{tag(a)}{op}{tag(b) if op == '+' else b}="


def render(op: str, steps: list[Column], final_carry: int, width: int) -> str:
    """The completion: fixed-width steps with the running result, then the answer."""
    parts = []
    running = ""
    for i, (x, y, c, t, u) in enumerate(steps):
        running = f"{u}{running}"
        parts.append(f"{PLACES[i]}{x}{op}{y}+{c}={t}{running.ljust(width)}")
    lead = str(final_carry) if final_carry else " "
    return f"{''.join(parts)}{ANSWER_MARKER}{lead}{running}"


def solution(op: str, a: int, b: int, width: int) -> str:
    """The correct worked completion."""
    return render(op, *columns(op, a, b), width)


def max_chars(width: int) -> int:
    """Longest completion: `width` steps of 8 + width chars, '#', carry, `width` digits."""
    return width * (8 + width) + 2 + width


@dataclass(frozen=True)
class ArithmeticOptions:
    """`task.arithmetic.*`: operand lengths, and the teacher's carry-drop probability."""

    min_digits: int = 2
    max_digits: int = 6
    carry_drop_prob: float = 0.4  # the teacher drops each non-zero carry this often

    def __post_init__(self) -> None:
        check(self.min_digits >= 1, "task.arithmetic.min_digits", self.min_digits, ">= 1")
        check(
            self.max_digits >= self.min_digits,
            "task.arithmetic.max_digits",
            self.max_digits,
            f">= min_digits={self.min_digits}",
        )
        check(
            0 <= self.carry_drop_prob < 1,
            "task.arithmetic.carry_drop_prob",
            self.carry_drop_prob,
            "[0, 1)",
        )


class ArithmeticTask(SyntheticTask):
    name = "arithmetic"
    Options: ClassVar[type] = ArithmeticOptions
    NOISE_FIELDS = ("carry_drop_prob",)

    def sample_problem(self, rng: np.random.Generator, cfg: ArithmeticOptions) -> Problem:
        if cfg.max_digits > len(PLACES):
            raise ValueError(
                f"task.arithmetic.max_digits={cfg.max_digits} is too large for arithmetic; "
                f"allowed: at most {len(PLACES)} (one place letter per column)"
            )
        a = sample_operand(rng, cfg)
        if rng.random() < ADD_FRACTION:
            return self.make("+", a, sample_operand(rng, cfg), cfg.max_digits)
        return self.make("*", a, int(MULTIPLIERS[draw(rng, _MULT_CDF)]), cfg.max_digits)

    def make(self, op: str, a: int, b: int, width: int | None = None) -> Problem:
        """The problem `a op b` ('+': a, b >= 0; '*': a >= 0, b a single digit).

        `width`: the running-result width of the worked solution; at least the number of
        columns (the default), at most len(PLACES).
        """
        columns_needed = column_count(op, a, b)
        width = columns_needed if width is None else width
        if op not in ("+", "*") or a < 0 or b < 0 or (op == "*" and b > 9):
            raise ValueError(
                f"arithmetic problem {a}{op}{b} is invalid; allowed: a+b or a*d "
                "with non-negative integers and a single digit d"
            )
        if not columns_needed <= width <= len(PLACES):
            raise ValueError(
                f"width={width} is invalid for {a}{op}{b}; allowed: {columns_needed}.."
                f"{len(PLACES)} (task.max_digits may be at most {len(PLACES)})"
            )
        answer = a + b if op == "+" else a * b
        meta = {"op": op, "a": a, "b": b, "carries": count_carries(op, a, b), "width": width}
        return make_problem(self.name, prompt_text(op, a, b), str(answer), meta)

    def teacher_solution(
        self, problem: Problem, rng: np.random.Generator, options: ArithmeticOptions
    ) -> str:
        op, a, b = problem.meta["op"], int(problem.meta["a"]), int(problem.meta["b"])
        n = column_count(op, a, b)
        # One draw per column, used only where that column's carry-out is non-zero.
        drop = rng.random(n) < options.carry_drop_prob
        return render(op, *columns(op, a, b, drop), int(problem.meta["width"]))

    def slipped_solution(
        self, problem: Problem, rng: np.random.Generator, options: ArithmeticOptions
    ) -> str:
        """One slip (SLIPS, uniform) at a uniform column: a wrong operand digit, result
        digit or carry carried through the later columns, or a correct chain whose answer
        miscopies one digit. The result may still be right (a carry slip can cancel out);
        the verifier labels it."""
        op, a, b = problem.meta["op"], int(problem.meta["a"]), int(problem.meta["b"])
        width = int(problem.meta["width"])
        n = column_count(op, a, b)
        kind = SLIPS[int(rng.integers(len(SLIPS)))]
        at = int(rng.integers(n))
        delta = int(rng.integers(1, 10))
        if kind != "answer":
            return render(op, *slipped_columns(op, a, b, at, kind, delta), width)
        text = render(op, *columns(op, a, b), width)
        head, answer = text.rsplit(ANSWER_MARKER, 1)
        digits = [i for i, ch in enumerate(answer) if ch.isdigit()]
        i = digits[int(rng.integers(len(digits)))]
        slipped = str((int(answer[i]) + delta) % 10)
        return f"{head}{ANSWER_MARKER}{answer[:i]}{slipped}{answer[i + 1 :]}"

    def extract_answer(self, completion: str) -> str | None:
        return final_answer(completion, MAX_ANSWER_CHARS)

    def verify(self, problem: Problem, completion: str) -> float:
        return integer_reward(self.extract_answer(completion), problem.answer)

    def max_completion_chars(self, cfg: ArithmeticOptions) -> int:
        return max_chars(cfg.max_digits)
