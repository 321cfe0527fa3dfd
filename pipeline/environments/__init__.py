"""Registry of multi-turn environments: `ENVIRONMENTS[name]` builds one from the run's
`environment` config section (`pipeline.environments.config.EnvironmentConfig`).

    "none"    single-turn episodes: one turn, no observation (the default; the rollout
              worker then samples as it always did)
    "python"  the Python tool: a turn ending in a ```python block runs it in the sandbox
              (`pipeline/environments/python_tool.py`)

A new tool (a calculator, a search index) is an `Environment` subclass and one
`register_environment(name, factory)` call (a line below for a built-in one); the config,
the rollout worker and the evaluator pick it up by name. The registry and the section
that validates `environment.name` against it live in `pipeline/environments/config.py`.
"""

from __future__ import annotations

from pipeline.environments.base import Environment, StepResult
from pipeline.environments.config import (
    ENVIRONMENTS,
    NONE,
    EnvironmentConfig,
    SingleTurn,
    known,
    register_environment,
)
from pipeline.environments.python_tool import PythonTool

register_environment(PythonTool.name, PythonTool.from_config)


class UnknownEnvironmentError(KeyError):
    """No environment of that name is registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


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
    "EnvironmentConfig",
    "PythonTool",
    "SingleTurn",
    "StepResult",
    "UnknownEnvironmentError",
    "make_environment",
    "register_environment",
]
