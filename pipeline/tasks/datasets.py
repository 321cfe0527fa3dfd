"""Built-in evaluation sets, by name: `DATASETS[name]()` returns their problems.

They ship with locked dependencies (no download), so `rlax eval --dataset NAME` can score
any run's versions on a fixed benchmark beside its own held-out set.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.tasks.base import Problem
from pipeline.tasks.humaneval import load_humaneval

DATASETS: dict[str, Callable[[], list[Problem]]] = {"humaneval": load_humaneval}


def load_dataset(name: str) -> list[Problem]:
    """The problems of built-in set `name`; ValueError listing the known sets otherwise."""
    if name not in DATASETS:
        raise ValueError(f"dataset {name!r} is unknown; known datasets: {', '.join(DATASETS)}")
    return DATASETS[name]()
