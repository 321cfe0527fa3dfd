"""Functional views of the model shared by the SFT bootstrap, trainer, worker and evaluator.

The jitted steps take parameters as a pytree argument (never as closure constants), so
one compiled program serves every weight version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from pipeline.config import ModelConfig
from tpu_jobs.model.transformer import (
    Transformer,
    flat_params,
    init_model,
    load_flat_params,
    sequence_logprobs,
)


@dataclass
class ModelFns:
    """A model split into a static graph and a parameter pytree."""

    graphdef: Any
    rest: tuple[Any, ...]

    def merge(self, params: Any) -> Transformer:
        return nnx.merge(self.graphdef, params, *self.rest)

    def logprobs(
        self,
        params: Any,
        tokens: jax.Array,
        mask: jax.Array,
        temperature: float = 1.0,
        *,
        first: int = 0,
    ) -> jax.Array:
        """`model.sequence_logprobs` of the model with `params` (columns first..)."""
        return sequence_logprobs(self.merge(params), tokens, mask, temperature, first=first)


def split_model(model: Transformer) -> tuple[ModelFns, Any]:
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
    return ModelFns(graphdef, tuple(rest)), params


def new_model(cfg: ModelConfig, seed: int) -> tuple[ModelFns, Any]:
    return split_model(init_model(cfg, seed))


def params_to_flat(fns: ModelFns, params: Any) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in flat_params(fns.merge(params)).items()}


def flat_to_params(fns: ModelFns, params_like: Any, flat: dict[str, np.ndarray]) -> Any:
    """New params with the values of `flat`; `params_like` (shapes, dtypes) is left as is
    (merging it directly would share its variables, and loading would overwrite them)."""
    model = fns.merge(jax.tree.map(lambda x: x, params_like))
    load_flat_params(model, flat)
    return nnx.split(model, nnx.Param, ...)[1]


def make_optimizer(
    lr: float, warmup_steps: int, total_steps: int, weight_decay: float, grad_clip: float
) -> optax.GradientTransformation:
    """AdamW with global-norm clipping, linear warm-up then cosine decay to 10% of lr."""
    warmup = max(1, min(warmup_steps, max(1, total_steps - 1)))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=lr * 0.01,
        peak_value=lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=lr * 0.1,
    )
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=weight_decay),
    )
