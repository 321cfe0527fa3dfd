"""Models with random (not init-like) weights for tests: logits that differ by O(1)
between tokens, so numerical comparisons and argmax checks mean something."""

from __future__ import annotations

import numpy as np

from pipeline.config import ModelConfig
from tpu_jobs.model.transformer import Transformer, flat_params, init_model, load_flat_params


def random_model(
    cfg: ModelConfig, seed: int, std: float = 0.2, norm_std: float = 0.2
) -> Transformer:
    """Every tensor random: norm weights (any `*norm.weight`, q/k norms included)
    1 + norm_std * N(0, 1), the rest (biases too) std * N(0, 1)."""
    model = init_model(cfg, 0)
    rng = np.random.default_rng(seed)
    flat = {}
    for name, value in flat_params(model).items():
        if name.endswith("norm.weight"):
            flat[name] = (1.0 + norm_std * rng.standard_normal(value.shape)).astype(np.float32)
        else:
            flat[name] = (std * rng.standard_normal(value.shape)).astype(np.float32)
    load_flat_params(model, flat)
    return model
