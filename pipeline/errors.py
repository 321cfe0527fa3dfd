"""`ConfigError` and the one-line checks that every config section and the loss
specification (`pipeline.algorithms`) raise it with.

A module of its own so that `pipeline.config` and `pipeline.algorithms` share one error
and one message format without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


class ArgumentError(ConfigError):
    """A command-line argument (not a config field) is out of range or unusable."""


def check(
    cond: bool, name: str, value: Any, allowed: str, error: type[ConfigError] = ConfigError
) -> None:
    """Raise `error` "{name}={value!r} is invalid; allowed: {allowed}" unless `cond`."""
    if not cond:
        raise error(f"{name}={value!r} is invalid; allowed: {allowed}")


def one_of_text(choices: Iterable[str]) -> str:
    """The "allowed" text of a choice: "one of 'a', 'b'"."""
    return "one of " + ", ".join(map(repr, choices))


def one_of(name: str, value: Any, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    check(value in choices, name, value, one_of_text(choices))
