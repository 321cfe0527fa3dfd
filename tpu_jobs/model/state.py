"""Functional views of the model shared by the SFT bootstrap, trainer, worker and evaluator.

The jitted steps take parameters as a pytree argument (never as closure constants), so
one compiled program serves every weight version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pipeline.config import ModelConfig
from pipeline.lora import LoraConfig
from tpu_jobs.model.transformer import (
    Transformer,
    flat_params,
    init_model,
    load_flat_params,
    sequence_logprobs,
)


@dataclass
class ModelFns:
    """A model split into a static graph and a parameter pytree. With LoRA adapters
    (`split_lora`) the pytree is the adapters' and `base` the frozen rest of the params."""

    graphdef: Any
    rest: tuple[Any, ...]

    def merge(self, params: Any, base: Any = None, dropout_key: Any = None) -> Transformer:
        """The model; `dropout_key`: a training forward's key of LoRA dropout (on the
        adapters' inputs, `lora.dropout`), None: none."""
        frozen = () if base is None else (base,)
        model = nnx.merge(self.graphdef, params, *frozen, *self.rest)
        if dropout_key is not None:  # read by Transformer.hidden (not in the graph: per step)
            model.lora_dropout_key = nnx.Variable(dropout_key)
        return model

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


def split_lora(model: Transformer) -> tuple[ModelFns, Any, Any]:
    """(functions, adapters, frozen base) of a model with LoRA adapters: the split by
    `nnx.LoRAParam`, so gradients and optimizer state exist for the adapters only."""
    graphdef, adapters, base, *rest = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
    return ModelFns(graphdef, tuple(rest)), adapters, base


def new_lora_model(cfg: ModelConfig, lora: LoraConfig, seed: int) -> tuple[ModelFns, Any, Any]:
    return split_lora(init_model(cfg, seed, lora))


def state_to_flat(state: Any) -> dict[str, np.ndarray]:
    """{dotted name: host array} of a parameter state (an `nnx.State`, e.g. the adapters of
    `split_lora`): the names `flat_params` gives the same tensors in the whole model."""
    return {
        ".".join(str(p) for p in path): np.asarray(jax.device_get(var[...]))
        for path, var in nnx.to_flat_state(state)
    }


def flat_to_state(state_like: Any, flat: dict[str, np.ndarray]) -> Any:
    """A new state shaped as `state_like` (arrays or `jax.ShapeDtypeStruct`s) with the
    values of `flat` cast to each leaf's dtype; ValueError naming the missing, unexpected
    and mis-shaped tensors."""
    leaves = [
        (".".join(str(p) for p in path), path, var) for path, var in nnx.to_flat_state(state_like)
    ]
    want = {name: tuple(var.shape) for name, _, var in leaves}
    missing, unexpected = sorted(set(want) - set(flat)), sorted(set(flat) - set(want))
    misshaped = [
        f"{k}: got {tuple(np.shape(flat[k]))}, expected {want[k]}"
        for k in sorted(set(want) & set(flat))
        if tuple(np.shape(flat[k])) != want[k]
    ]
    if missing or unexpected or misshaped:
        raise ValueError(
            f"the tensors do not match the state: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}, mis-shaped {misshaped[:4]}"
        )
    return nnx.from_flat_state(
        [(path, var.replace(jnp.asarray(flat[name], var.dtype))) for name, path, var in leaves]
    )


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
