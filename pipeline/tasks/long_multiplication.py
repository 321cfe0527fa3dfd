"""Long multiplication with a Python tool: `d`-digit by `d`-digit products, beyond what the
small demo model computes in its head, exact in one line of Python.

Formats for 347*862 (d = 3; the answer marker is '#'):

    prompt              347*862=
    with the tool       ```python
                        print(347*862)
                        ```
                        ```output          <- the observation: written by the environment
                        299114                (pipeline.environments), not by the policy
                        ```
                        #299114
    by hand             #299714

The completion of a tool episode is its turns and observations in order
(`pipeline.tool_calls`); the verifier reads the answer after the last '#', which only the
policy writes (the observation holds no marker).

Why this shape. Both operands have exactly `d` digits and their product exactly 2d
(problems with a shorter product are redrawn), so every prompt, program and answer has
the same length: each character the policy writes on the tool path is a copy from a fixed
distance (an operand digit from the prompt, an answer digit from the observation), which a
3-layer char model learns in a few hundred SFT steps, while the product itself (the hand
path) is far beyond it. So whether a sample calls the tool decides almost all of its
reward: the decision RL has to learn.

Teacher (`Options`): with probability `tool_prob` it calls the tool (and then answers
with the tool's output, always right); otherwise it answers by hand with its usual
mistakes: each digit of the product is replaced by another digit with probability
`digit_error_prob` (the noise field: `noiseless` makes the hand path exact). The teacher's
observation is `pipeline.tool_calls.observation` of what the program prints, the text
the environment appends; SFT does not train on it (`teacher_pieces`).
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
from pipeline.tool_calls import CALL_CLOSE, CALL_OPEN, observation

MAX_DIGITS = 9  # products of at most 18 digits: a program's output stays one short line
OBSERVATION_CHARS = 64  # the teacher's observation cut (the product is far shorter)


def program(a: int, b: int) -> str:
    """The one-line program the teacher calls the tool with."""
    return f"print({a}*{b})\n"


@dataclass(frozen=True)
class LongMultiplicationOptions:
    """`task.long_multiplication.*`: operand digits, and the teacher's habits."""

    digits: int = 3
    tool_prob: float = 0.3  # the teacher calls the tool this often
    digit_error_prob: float = 0.3  # by hand, each product digit is wrong this often

    def __post_init__(self) -> None:
        check(
            2 <= self.digits <= MAX_DIGITS,
            "task.long_multiplication.digits",
            self.digits,
            f"2..{MAX_DIGITS}",
        )
        check(
            0 <= self.tool_prob <= 1,
            "task.long_multiplication.tool_prob",
            self.tool_prob,
            "[0, 1]",
        )
        check(
            0 <= self.digit_error_prob < 1,
            "task.long_multiplication.digit_error_prob",
            self.digit_error_prob,
            "[0, 1)",
        )


class LongMultiplicationTask(SyntheticTask):
    name = "long_multiplication"
    Options: ClassVar[type] = LongMultiplicationOptions
    NOISE_FIELDS = ("digit_error_prob",)

    def sample_problem(self, rng: np.random.Generator, cfg: LongMultiplicationOptions) -> Problem:
        lo, hi = 10 ** (cfg.digits - 1), 10**cfg.digits
        while True:  # about 1 in 4 draws has a product one digit short (d = 3)
            a, b = (int(x) for x in rng.integers(lo, hi, 2))
            if a * b >= 10 ** (2 * cfg.digits - 1):
                return self.make(a, b)

    def make(self, a: int, b: int) -> Problem:
        """The problem `a*b`: operands of the same number of digits (2..MAX_DIGITS) whose
        product has twice as many."""
        d = len(str(a))
        if not (
            a > 0
            and b > 0
            and len(str(b)) == d
            and 2 <= d <= MAX_DIGITS
            and len(str(a * b)) == 2 * d
        ):
            raise ValueError(
                f"long multiplication {a}*{b} is invalid; allowed: two positive operands of "
                f"the same number of digits (2..{MAX_DIGITS}) whose product has twice as many"
            )
        return make_problem(self.name, f"{a}*{b}=", str(a * b), {"a": a, "b": b, "digits": d})

    def teacher_pieces(
        self, problem: Problem, rng: np.random.Generator, options: LongMultiplicationOptions
    ) -> list[tuple[str, bool]]:
        a, b = int(problem.meta["a"]), int(problem.meta["b"])
        # Both draws are made whichever path is taken, so the teacher's stream does not
        # depend on its own coin.
        use_tool = rng.random() < options.tool_prob
        slips = rng.random(len(problem.answer)) < options.digit_error_prob
        shifts = rng.integers(1, 10, len(problem.answer))
        if use_tool:
            call = CALL_OPEN + program(a, b) + CALL_CLOSE
            out = observation(f"{a * b}\n", OBSERVATION_CHARS)
            return [(call, True), (out, False), (ANSWER_MARKER + problem.answer, True)]
        digits = [
            str((int(c) + int(s)) % 10) if slip else c
            for c, slip, s in zip(problem.answer, slips, shifts, strict=True)
        ]
        return [(ANSWER_MARKER + "".join(digits), True)]

    def teacher_solution(
        self, problem: Problem, rng: np.random.Generator, options: LongMultiplicationOptions
    ) -> str:
        return "".join(text for text, _ in self.teacher_pieces(problem, rng, options))

    def extract_answer(self, completion: str) -> str | None:
        return final_answer(completion, 2 * MAX_DIGITS + 2)

    def verify(self, problem: Problem, completion: str) -> float:
        return integer_reward(self.extract_answer(completion), problem.answer)

    def max_completion_chars(self, cfg: LongMultiplicationOptions) -> int:
        d = cfg.digits
        call = len(CALL_OPEN) + len(program(10 ** (d - 1), 10 ** (d - 1))) + len(CALL_CLOSE)
        out = len(observation("9" * (2 * d) + "\n", OBSERVATION_CHARS))
        return call + out + 1 + 2 * d
