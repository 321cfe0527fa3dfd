"""A sampler's copies of one weight version: recognised by array identity (a new version
comes as new arrays) and cast to the compute dtype once, not in every call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from tpu_jobs.model.transformer import DTYPES


def same_arrays(held: Sequence[Any], given: Sequence[Any]) -> bool:
    """Whether `given` are the very arrays held (identity, not values): a sampler keeps
    what it derived from one weight version (a cast copy, a server's weights) until the
    job loads another version, which comes as new arrays."""
    return len(held) == len(given) and all(a is b for a, b in zip(held, given, strict=True))


def cast_state(state: nnx.State, dtype: str) -> nnx.State:
    """`state` with every array in the compute dtype `dtype` (a name in DTYPES)."""
    cdt = DTYPES[dtype]
    return jax.tree.map(lambda a: a.astype(cdt) if a.dtype != cdt else a, state)
