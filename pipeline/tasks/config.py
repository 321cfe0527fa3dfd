"""The run's `task` section: the problem mix, and a section `task.<family>` of options for
every registered synthetic family (its `Options` dataclass), so a family declares its
options in one place (its module) and its line in `TASKS` is all the config needs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipeline.config_io import MIGRATIONS, move_keys
from pipeline.errors import check as _check
from pipeline.errors import one_of as _one_of
from pipeline.tasks import TASKS
from pipeline.tasks.base import SyntheticTask

# Synthetic problem sets are generated at a few thousand problems a second on one core, so
# a million takes minutes: larger sets come from curation (beam_jobs). docs/security.md,
# "Inputs".
MAX_PROBLEMS = 1_000_000  # task.num_train, task.num_eval


@dataclass(frozen=True)
class _TaskMix:
    """Which verifiable task families make up the problem mix (the fields every run has);
    `TaskConfig` adds one section per synthetic family, below."""

    families: tuple[str, ...] = ("arithmetic", "countdown")
    weights: tuple[float, ...] = (0.75, 0.25)
    seed: int = 0
    num_train: int = 20000
    num_eval: int = 500

    def __post_init__(self) -> None:
        _check(len(self.families) > 0, "task.families", self.families, "a non-empty list")
        for fam in self.families:
            _one_of("task.families", fam, TASKS)
        _check(
            len(self.weights) == len(self.families) and all(w > 0 for w in self.weights),
            "task.weights",
            self.weights,
            f"{len(self.families)} positive numbers, one per family",
        )
        _check(self.seed >= 0, "task.seed", self.seed, ">= 0")
        for name in ("num_train", "num_eval"):
            value = getattr(self, name)
            _check(
                0 < value <= MAX_PROBLEMS,
                f"task.{name}",
                value,
                f"1..{MAX_PROBLEMS} (generated at a few thousand a second; larger sets "
                "come from curation)",
            )

    def options_for(self, family: str) -> Any:
        """The `task.<family>` options of a synthetic family (its `Options` dataclass)."""
        return getattr(self, family)


def _task_config_class() -> type:
    """TaskConfig: the mix's fields plus a section `task.<name>` of the family's own
    `Options` type for every registered synthetic family."""
    sections = [
        (name, task.Options, field(default_factory=task.Options))
        for name, task in sorted(TASKS.items())
        if isinstance(task, SyntheticTask)
    ]
    cls = dataclasses.make_dataclass("TaskConfig", sections, bases=(_TaskMix,), frozen=True)
    cls.__module__ = __name__  # pickles (Beam, multiprocessing) find it here
    cls.__doc__ = (
        "Which verifiable task families make up the problem mix, and each synthetic "
        f"family's options: task.{{{', '.join(name for name, _, _ in sections)}}}."
    )
    return cls


TaskConfig = _task_config_class()

# A TaskConfig built alone from an old-shaped mapping (the run config's migration moves
# the SFT keys too).
MIGRATIONS[TaskConfig] = lambda data: move_keys({"task": data}).get("task", {})
