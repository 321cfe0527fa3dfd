"""Train/eval problem sets drawn from the configured mix of task families.

Deterministic in `cfg` (seed included). Each problem's family is drawn by `cfg.weights`;
the eval set is drawn first and the train set rejects every eval `problem_id`, so the two
are disjoint, and neither holds a problem twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipeline.tasks import get_task
from pipeline.tasks.base import Problem, SyntheticTask

if TYPE_CHECKING:
    from pipeline.tasks.config import TaskConfig

_SPLIT_STREAM = 0x5B1175  # separates the split generator from other users of cfg.seed
# Rejection sampling gives up after this many draws per wanted problem (plus a margin):
# the configured families cannot make that many distinct problems.
_MAX_DRAWS_PER_PROBLEM = 20


def synthetic_task(name: str) -> SyntheticTask:
    """The registered family `name`, which must generate problems: a dataset family
    (math, code) has only a verifier, so its problems come from curated data."""
    task = get_task(name)
    if not isinstance(task, SyntheticTask):
        from pipeline.tasks import TASKS

        makers = sorted(n for n, t in TASKS.items() if isinstance(t, SyntheticTask))
        raise ValueError(
            f"task family {name!r} has a verifier but no problem generator: bring its "
            "problems as curated data (the rlax_rl_training DAG's source_data param, "
            "which runs the Beam curation job); families that generate problems: "
            f"{', '.join(makers)}"
        )
    return task


def _options_text(cfg: TaskConfig) -> str:
    return "; ".join(f"task.{f}: {cfg.options_for(f)}" for f in cfg.families)


def _draw(
    rng: np.random.Generator, cfg: TaskConfig, n: int, exclude: set[str], split: str
) -> list[Problem]:
    tasks = [synthetic_task(f) for f in cfg.families]
    cdf = np.cumsum(np.asarray(cfg.weights, dtype=np.float64))
    cdf /= cdf[-1]
    out: list[Problem] = []
    seen = set(exclude)
    budget = _MAX_DRAWS_PER_PROBLEM * n + 1000
    while len(out) < n:
        if budget == 0:
            raise ValueError(
                f"could only draw {len(out)} distinct {split} problems of {n} wanted from "
                f"families {cfg.families} ({_options_text(cfg)}); lower task.num_{split} "
                "or widen the families' options"
            )
        budget -= 1
        task = tasks[min(int(np.searchsorted(cdf, rng.random(), side="right")), len(tasks) - 1)]
        problem = task.sample_problem(rng, cfg.options_for(task.name))
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
