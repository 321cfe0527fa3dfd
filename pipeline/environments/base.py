"""What an environment is: it reads a finished turn's text and answers with an
observation (appended to the sequence, not trained on) and whether the episode is done.

Pure text: the token-level loop (`tpu_jobs.generate.episodes`) turns text into tokens, drives the
engine and calls `step_many` with every turn that ended in one round, so an environment
that runs programs (the Python tool) runs them together.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pipeline.tool_calls import ERROR_KINDS


@dataclass(frozen=True)
class StepResult:
    """An environment's answer to one finished turn.

    observation: text appended after the turn before generation resumes (None: nothing is
        appended; the episode then ends whatever `done` says).
    done: the episode ends after this turn.
    called: the turn called a tool (a failed or malformed call included).
    error: why the call failed, one of `pipeline.tool_calls.ERROR_KINDS`, or None.
    """

    observation: str | None
    done: bool
    called: bool = False
    error: str | None = None

    def __post_init__(self) -> None:
        if self.error is not None and self.error not in ERROR_KINDS:
            raise ValueError(
                f"tool error kind {self.error!r} is unknown; allowed: {', '.join(ERROR_KINDS)}"
            )
        if self.error is not None and not self.called:
            raise ValueError("a step with a tool error must be a call (called=True)")


# The answer to a turn that ends the episode without calling anything.
FINAL = StepResult(observation=None, done=True)


class Environment(ABC):
    """A multi-turn environment. `stop_strings`: the texts that end a turn (besides EOS
    and the per-turn token limit), passed to the engine as stop sequences."""

    name: ClassVar[str]
    stop_strings: tuple[str, ...] = ()

    @abstractmethod
    def step(self, turn: str) -> StepResult:
        """The answer to one finished turn (its text, from the turn's first token on)."""

    def step_many(self, turns: Sequence[str]) -> list[StepResult]:
        """The answers to several finished turns (of different episodes), in order; an
        environment whose steps wait on something (programs, a service) overrides this
        to serve them together."""
        return [self.step(t) for t in turns]
