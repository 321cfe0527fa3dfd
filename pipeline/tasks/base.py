"""Problems and the `Task` interface every verifiable task family implements.

A completion is free text (the worked solution) that ends with the final-answer marker
`ANSWER_MARKER` followed by the answer; verifiers read only what follows the LAST marker,
so a model may think aloud, even write the marker, before committing to an answer.
Verifiers never raise and never execute model text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

ANSWER_MARKER = "#"
# Every verifier's reward lies here (`Task.verify`); the trainer refuses batches outside it.
REWARD_RANGE = (0.0, 1.0)


def problem_id(task: str, content: str) -> str:
    """Stable id: sha1 of the family name and the canonical problem text, 16 hex chars."""
    return hashlib.sha1(f"{task}\x00{content}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Problem:
    """One verifiable problem; `meta` is a JSON-serialisable dict the verifier may use."""

    problem_id: str
    task: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:  # meta is a dict; the id identifies the problem
        return hash(self.problem_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "problem_id": self.problem_id,
            "task": self.task,
            "prompt": self.prompt,
            "answer": self.answer,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Problem:
        """Inverse of `to_dict`; `meta` may also be the JSON text stored in Parquet."""
        missing = [k for k in ("problem_id", "task", "prompt", "answer") if k not in row]
        if missing:
            raise ValueError(f"problem row lacks {missing}; needs problem_id, task, prompt, answer")
        meta = row.get("meta") or {}
        if isinstance(meta, str):
            meta = json.loads(meta)
        return cls(
            problem_id=str(row["problem_id"]),
            task=str(row["task"]),
            prompt=str(row["prompt"]),
            answer=str(row["answer"]),
            meta=dict(meta),
        )


def make_problem(task: str, prompt: str, answer: str, meta: dict[str, Any]) -> Problem:
    """A problem whose id hashes the prompt (each family's prompt is canonical)."""
    return Problem(problem_id(task, prompt), task, prompt, answer, meta)


def final_answer(completion: str, max_chars: int) -> str | None:
    """Text after the last `ANSWER_MARKER`, spaces stripped; None if absent or too long."""
    if not isinstance(completion, str):
        return None
    at = completion.rfind(ANSWER_MARKER)
    if at < 0:
        return None
    tail = completion[at + len(ANSWER_MARKER) :]
    if len(tail) > max_chars:  # bound the work before any stripping or parsing
        return None
    return tail.strip(" ")


_INT_LITERAL = re.compile(r"-?[0-9]{1,40}")  # ASCII only: int() would accept '１２'


def integer_reward(answer: str | None, expected: str) -> float:
    """1.0 when `answer` (an extracted final answer) is an ASCII integer literal equal to
    `expected`, else 0.0."""
    if answer is None or not _INT_LITERAL.fullmatch(answer):
        return 0.0
    return 1.0 if int(answer) == int(expected) else 0.0


class Task(ABC):
    """A verifiable task family: how to read a completion's answer and score it.

    A family whose problems come from a dataset (math, code) needs only this; a synthetic
    family is a `SyntheticTask`, which adds a problem generator and a noisy teacher.
    """

    name: ClassVar[str]

    @abstractmethod
    def extract_answer(self, completion: str) -> str | None:
        """The completion's final answer (maj@k votes on it), or None when it has none."""

    @abstractmethod
    def verify(self, problem: Problem, completion: str) -> float:
        """Reward in REWARD_RANGE ([0, 1]). Never raises; model text runs only in the
        sandbox (`pipeline.sandbox`), never in this process."""

    def verify_batch(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        """`verify` of each pair; families that run a sandbox override it to run the whole
        batch concurrently."""
        return [self.verify(p, c) for p, c in zip(problems, completions, strict=True)]

    def check_problem(self, problem: Problem) -> None:
        """Raise ValueError naming what is missing when `problem` cannot be verified by
        this family (curated data is checked before a run starts); default: anything goes."""
        del problem


class SyntheticTask(Task):
    """A family that also generates its problems and demonstrates them (the SFT teacher).

    `Options` is the family's own frozen dataclass of generator and teacher options, in
    one place: the run config gets a section `task.<name>` of that type for every
    registered synthetic family (`pipeline.tasks.config.TaskConfig`), validated by the
    dataclass itself. `NOISE_FIELDS` name the options that make the teacher err.
    """

    Options: ClassVar[type]
    NOISE_FIELDS: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def sample_problem(self, rng: np.random.Generator, options: Any) -> Problem:
        """One random problem (deterministic given the generator state)."""

    @abstractmethod
    def teacher_solution(self, problem: Problem, rng: np.random.Generator, options: Any) -> str:
        """A worked completion (without EOS) carrying the teacher's systematic mistakes."""

    def teacher_pieces(
        self, problem: Problem, rng: np.random.Generator, options: Any
    ) -> list[tuple[str, bool]]:
        """`teacher_solution` as (text, sampled) pieces in order: `sampled` is False for
        text the policy would not write itself (a tool's observation in a tool episode,
        `pipeline.tool_calls`), which SFT does not train on. The same draws as
        `teacher_solution`; by default one sampled piece."""
        return [(self.teacher_solution(problem, rng, options), True)]

    def slipped_solution(
        self, problem: Problem, rng: np.random.Generator, options: Any
    ) -> str | None:
        """A worked completion (without EOS) with one random slip of the kind a sampling
        policy makes (a wrong digit, a misread operand, a miscopied answer), the rest of it
        consistent with the slip; judging demonstrations (`sft.judge_labels: slips`) show
        it as a wrong solution beside the teacher's own mistakes. None: the family has no
        slips (its wrong demonstrations are the teacher's)."""
        del problem, rng, options
        return None

    def has_teacher(self, problem: Problem) -> bool:
        """Whether `teacher_solution` can demonstrate `problem`: a family that also scores
        curated dataset problems (code) has a teacher only for the ones it generated."""
        del problem
        return True

    @abstractmethod
    def max_completion_chars(self, options: Any) -> int:
        """An upper bound on the length of any teacher completion under `options`."""

    def noiseless(self, options: Any) -> Any:
        """`options` with the teacher's mistakes turned off (a perfect demonstration)."""
        return dataclasses.replace(options, **dict.fromkeys(self.NOISE_FIELDS, 0.0))
