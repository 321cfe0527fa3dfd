"""Train/eval problem sets drawn from the configured mix of task families.

Deterministic in `cfg` (seed included). Each problem's family is drawn by `cfg.weights`;
the eval set is drawn first and the train set rejects every eval `problem_id`, so the two
are disjoint, and neither holds a problem twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipeline.tasks import get_task
from pipeline.tasks.base import Problem

if TYPE_CHECKING:
    from pipeline.config import TaskConfig

_SPLIT_STREAM = 0x5B1175  # separates the split generator from other users of cfg.seed
# Rejection sampling gives up after this many draws per wanted problem (plus a margin):
# the configured families cannot make that many distinct problems.
_MAX_DRAWS_PER_PROBLEM = 20


def _draw(
    rng: np.random.Generator, cfg: TaskConfig, n: int, exclude: set[str], split: str
) -> list[Problem]:
    tasks = [get_task(f) for f in cfg.families]
    cdf = np.cumsum(np.asarray(cfg.weights, dtype=np.float64))
    cdf /= cdf[-1]
    out: list[Problem] = []
    seen = set(exclude)
    budget = _MAX_DRAWS_PER_PROBLEM * n + 1000
    while len(out) < n:
        if budget == 0:
            raise ValueError(
                f"could only draw {len(out)} distinct {split} problems of {n} wanted from "
                f"families {cfg.families} (min_digits={cfg.min_digits}, max_digits="
                f"{cfg.max_digits}); lower task.num_{split} or widen the digit range"
            )
        budget -= 1
        task = tasks[min(int(np.searchsorted(cdf, rng.random(), side="right")), len(tasks) - 1)]
        problem = task.sample_problem(rng, cfg)
        if problem.problem_id in seen:
            continue
        seen.add(problem.problem_id)
        out.append(problem)
    return out


def build_splits(cfg: TaskConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, eval): `cfg.num_train` and `cfg.num_eval` distinct, disjoint problems."""
    rng = np.random.default_rng([cfg.seed, _SPLIT_STREAM])
    eval_set = _draw(rng, cfg, cfg.num_eval, set(), "eval")
    train = _draw(rng, cfg, cfg.num_train, {p.problem_id for p in eval_set}, "train")
    return train, eval_set
