"""The run's `environment` section and the registry of environments it names.

Both live here, together, because each refers to the other: the section checks
`environment.name` against `ENVIRONMENTS`, and every factory there takes the section.
The environments themselves register into it (`pipeline/environments/__init__.py`), and
nothing else lists their names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.environments.base import FINAL, Environment, StepResult
from pipeline.errors import check as _check
from pipeline.errors import one_of as _one_of
from pipeline.tool_calls import TRUNCATED

NONE = "none"


class SingleTurn(Environment):
    """One turn per episode: every turn is final (today's single-turn sampling)."""

    name = NONE

    def step(self, turn: str) -> StepResult:
        return FINAL


@dataclass(frozen=True)
class EnvironmentConfig:
    """Multi-turn episodes with a tool (`pipeline.environments`, `tpu_jobs.generate.episodes`).

    name: the environment (`ENVIRONMENTS`): "none" (the default) samples one turn per
        completion as before; "python" lets a turn call the Python tool
        (`pipeline.tool_calls`), whose output is appended and generation resumes.
    max_turns: generated turns per episode at most (the last one gets no observation).
    max_episode_tokens: the completion's budget: every turn's sampled tokens and every
        observation's tokens together; a turn samples at most min(sampler.max_new_tokens,
        what is left), and an observation that would leave no room ends the episode. The
        trainer's completion slots are this long when an environment is set.
    observation_chars: an observation's text is cut to this many characters.
    timeout_s, memory_mb: the sandbox limits of one tool call.
    failed_call_penalty: reward shaping: subtracted from the verifier's reward once per
        failed tool call (an error, timeout, memory or output-limit status, or a malformed
        call); 0 (the default) leaves the verifier's reward alone.
    """

    name: str = NONE
    max_turns: int = 4
    max_episode_tokens: int = 192
    observation_chars: int = 256
    timeout_s: float = 5.0
    memory_mb: int = 256
    failed_call_penalty: float = 0.0

    def __post_init__(self) -> None:
        _one_of("environment.name", self.name, ENVIRONMENTS)
        _check(self.max_turns >= 1, "environment.max_turns", self.max_turns, ">= 1")
        _check(
            self.max_episode_tokens >= 1,
            "environment.max_episode_tokens",
            self.max_episode_tokens,
            ">= 1 token",
        )
        _check(
            self.observation_chars > len(TRUNCATED),
            "environment.observation_chars",
            self.observation_chars,
            f"> {len(TRUNCATED)} characters (room for the truncation mark)",
        )
        _check(0 < self.timeout_s <= 600, "environment.timeout_s", self.timeout_s, "(0, 600] s")
        _check(self.memory_mb >= 64, "environment.memory_mb", self.memory_mb, ">= 64 MB")
        _check(
            0 <= self.failed_call_penalty <= 1,
            "environment.failed_call_penalty",
            self.failed_call_penalty,
            "[0, 1] (0: off)",
        )

    @property
    def multi_turn(self) -> bool:
        """Episodes go through the environment loop (any environment but "none")."""
        return self.name != NONE

    def reward_floor(self) -> float:
        """How far below the verifier's range shaping can take a reward."""
        return self.failed_call_penalty * self.max_turns if self.multi_turn else 0.0


# environment.name -> (the run's environment config) -> an Environment. The package's
# __init__ registers the others, so any import of this module sees all of them.
ENVIRONMENTS: dict[str, Callable[[EnvironmentConfig], Environment]] = {
    NONE: lambda cfg: SingleTurn(),
}


def known() -> str:
    return ", ".join(sorted(ENVIRONMENTS))


def register_environment(name: str, factory: Callable[[EnvironmentConfig], Environment]) -> None:
    """Make `factory` the environment called `name` (a name already taken is refused)."""
    if not name or not name.isidentifier():
        raise ValueError(f"environment name {name!r} is invalid; allowed: an identifier")
    if name in ENVIRONMENTS:
        raise ValueError(f"environment {name!r} is already registered; known: {known()}")
    ENVIRONMENTS[name] = factory
