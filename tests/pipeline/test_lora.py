"""The LoRA contract (`pipeline/lora.py`): which tensors carry adapters, their shapes,
and the merge, against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.lora import (
    LoraConfig,
    adapter_shapes,
    is_adapter,
    merge,
    split_adapters,
    target_modules,
)

BASE_SHAPES = {
    "embed_tokens.embedding": (10, 4),
    "layers.0.self_attn.q_proj.kernel": (4, 4),
    "layers.0.self_attn.k_proj.kernel": (4, 2),
    "layers.0.mlp.down_proj.kernel": (6, 4),
    "layers.1.self_attn.q_proj.kernel": (4, 4),
    "layers.1.input_layernorm.weight": (4,),
    "norm.weight": (4,),
}


def test_targets_pick_the_named_projections_of_every_layer():
    assert target_modules(BASE_SHAPES, ["q"]) == [
        "layers.0.self_attn.q_proj",
        "layers.1.self_attn.q_proj",
    ]
    assert target_modules(BASE_SHAPES, ["k", "down"]) == [
        "layers.0.mlp.down_proj",
        "layers.0.self_attn.k_proj",
    ]
    shapes = adapter_shapes(BASE_SHAPES, LoraConfig(rank=3, targets=("k", "down")))
    assert shapes == {
        "layers.0.mlp.down_proj.lora_a": (6, 3),
        "layers.0.mlp.down_proj.lora_b": (3, 4),
        "layers.0.self_attn.k_proj.lora_a": (4, 3),
        "layers.0.self_attn.k_proj.lora_b": (3, 2),
    }
    assert all(is_adapter(n) for n in shapes) and not is_adapter("norm.weight")


def test_merge_adds_scale_times_a_at_b_to_the_kernel_only():
    base = {
        "layers.0.self_attn.k_proj.kernel": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
        "norm.weight": np.ones(2, np.float32),
    }
    a = np.array([[1.0], [2.0]], np.float32)  # [d_in=2, r=1]
    b = np.array([[0.5, -1.0]], np.float32)  # [r=1, d_out=2]
    merged = merge(
        base, {"layers.0.self_attn.k_proj.lora_a": a, "layers.0.self_attn.k_proj.lora_b": b}, 2.0
    )
    # a @ b = [[0.5, -1], [1, -2]]; times 2 = [[1, -2], [2, -4]]
    np.testing.assert_array_equal(
        merged["layers.0.self_attn.k_proj.kernel"], np.array([[2.0, 0.0], [5.0, 0.0]])
    )
    assert merged["norm.weight"] is base["norm.weight"]
    assert base["layers.0.self_attn.k_proj.kernel"][0, 0] == 1.0  # the base is not changed


def test_merge_keeps_the_kernel_dtype_and_a_zero_b_gives_the_base():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    kernel = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    adapters = {"m.lora_a": np.ones((2, 4), np.float32), "m.lora_b": np.zeros((4, 3), np.float32)}
    merged = merge({"m.kernel": kernel}, adapters, 4.0)
    assert merged["m.kernel"].dtype == kernel.dtype
    np.testing.assert_array_equal(merged["m.kernel"], kernel)


def test_merge_refuses_unpaired_or_misnamed_or_misshapen_adapters():
    base = {"m.kernel": np.zeros((2, 2), np.float32)}
    with pytest.raises(ValueError, match="pairs"):
        merge(base, {"m.lora_a": np.zeros((2, 1), np.float32)}, 1.0)
    with pytest.raises(ValueError, match="no base kernel"):
        merge(base, {"x.lora_a": np.zeros((2, 1)), "x.lora_b": np.zeros((1, 2))}, 1.0)
    with pytest.raises(ValueError, match="update for a"):
        merge(base, {"m.lora_a": np.zeros((3, 1)), "m.lora_b": np.zeros((1, 2))}, 1.0)


def test_the_section_loads_from_overrides_and_refuses_bad_values():
    cfg = load_config("configs/tiny.yaml", ["lora.rank=8", "lora.alpha=32", "lora.targets=[q,v]"])
    assert (cfg.lora.enabled, cfg.lora.scale, cfg.lora.targets) == (True, 4.0, ("q", "v"))
    assert not load_config("configs/tiny.yaml").lora.enabled
    for bad, allowed in [
        ("lora.targets=[q,q]", "without repeats"),
        ("lora.targets=[attn]", "q, k, v, o, gate, up, down"),
        ("lora.base_dtype=float16", "float32 or bfloat16"),
    ]:
        with pytest.raises(ConfigError, match=allowed):
            load_config("configs/tiny.yaml", [bad])


def test_split_adapters_separates_base_and_adapter_tensors():
    flat = {
        "norm.weight": np.ones(4, np.float32),
        "layers.0.self_attn.q_proj.kernel": np.eye(4, dtype=np.float32),
        "layers.0.self_attn.q_proj.lora_a": np.ones((4, 2), np.float32),
        "layers.0.self_attn.q_proj.lora_b": np.zeros((2, 4), np.float32),
    }
    base, adapters = split_adapters(flat)
    assert sorted(base) == ["layers.0.self_attn.q_proj.kernel", "norm.weight"]
    assert sorted(adapters) == [
        "layers.0.self_attn.q_proj.lora_a",
        "layers.0.self_attn.q_proj.lora_b",
    ]
    assert adapters["layers.0.self_attn.q_proj.lora_a"] is flat["layers.0.self_attn.q_proj.lora_a"]
    again, none = split_adapters(base)  # full RL: no adapters
    assert none == {} and again.keys() == base.keys()
