"""Registry of multi-turn environments: `ENVIRONMENTS[name]` builds one from the run's
`environment` config section (`pipeline.config.EnvironmentConfig`).

    "none"    single-turn episodes: one turn, no observation (the default; the rollout
              worker then samples as it always did)
    "python"  the Python tool: a turn ending in a ```python block runs it in the sandbox
              (`pipeline/environments/python_tool.py`)

A new tool (a calculator, a search index) is an `Environment` subclass and one
`register_environment(name, factory)` call (or a line below); the config, the rollout
worker and the evaluator pick it up by name. Kept light: `pipeline.config` validates
`environment.name` against it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pipeline.environments.base import FINAL, Environment, StepResult
from pipeline.environments.python_tool import PythonTool

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig

NONE = "none"


class SingleTurn(Environment):
    """One turn per episode: every turn is final (today's single-turn sampling)."""

    name = NONE

    def step(self, turn: str) -> StepResult:
        return FINAL


# environment.name -> (the run's environment config) -> an Environment.
ENVIRONMENTS: dict[str, Callable[[EnvironmentConfig], Environment]] = {
    NONE: lambda cfg: SingleTurn(),
    PythonTool.name: PythonTool.from_config,
}


class UnknownEnvironmentError(KeyError):
    """No environment of that name is registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def known() -> str:
    return ", ".join(sorted(ENVIRONMENTS))


def register_environment(name: str, factory: Callable[[EnvironmentConfig], Environment]) -> None:
    """Make `factory` the environment called `name` (a name already taken is refused)."""
    if not name or not name.isidentifier():
        raise ValueError(f"environment name {name!r} is invalid; allowed: an identifier")
    if name in ENVIRONMENTS:
        raise ValueError(f"environment {name!r} is already registered; known: {known()}")
    ENVIRONMENTS[name] = factory


def make_environment(cfg: EnvironmentConfig) -> Environment:
    """The environment `cfg.name` names, built from `cfg`."""
    if cfg.name not in ENVIRONMENTS:
        raise UnknownEnvironmentError(
            f"environment {cfg.name!r} is unknown; known environments: {known()}"
        )
    return ENVIRONMENTS[cfg.name](cfg)


__all__ = [
    "ENVIRONMENTS",
    "NONE",
    "Environment",
    "PythonTool",
    "SingleTurn",
    "StepResult",
    "UnknownEnvironmentError",
    "make_environment",
    "register_environment",
]
