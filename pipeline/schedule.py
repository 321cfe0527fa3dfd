"""Which problems go into which rollout batch: a pure function of (seed, batch index).

Workers anywhere compute the same assignment, so a batch retried by another worker after
a preemption holds the same prompts and the run is reproducible.
"""

from __future__ import annotations

import numpy as np


def batch_problem_indices(
    index: int, prompts_per_batch: int, num_problems: int, seed: int
) -> np.ndarray:
    """Indices into the train set for batch `index`: consecutive slices of per-epoch permutations."""
    if num_problems <= 0:
        raise ValueError("the train set is empty; generate data first (`rlax init --run URL`)")
    start = index * prompts_per_batch
    out = np.empty(prompts_per_batch, np.int64)
    for j in range(prompts_per_batch):
        epoch, pos = divmod(start + j, num_problems)
        perm = _permutation(seed, epoch, num_problems)
        out[j] = perm[pos]
    return out


_PERM_CACHE: dict[tuple[int, int, int], np.ndarray] = {}


def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    key = (seed, epoch, n)
    if key not in _PERM_CACHE:
        _PERM_CACHE.clear()  # one epoch at a time is enough
        _PERM_CACHE[key] = np.random.default_rng([seed, epoch, 0x5EED]).permutation(n)
    return _PERM_CACHE[key]
