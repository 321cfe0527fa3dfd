"""LoRA adapters in PEFT's format: what `peft.PeftModel.from_pretrained` and vLLM's
`--enable-lora` read, to and from the project's adapter tensors (`pipeline.lora`).

An adapter directory holds `adapter_config.json` (`peft_type: LORA`, `r`, `lora_alpha`,
`target_modules`, `base_model_name_or_path`, ...) and `adapter_model.safetensors`, whose
tensors PEFT 0.21 names and shapes (checked against `peft.get_peft_model(...)
.save_pretrained`, tests/tpu_jobs/test_peft.py) as

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, d_in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [d_out, r]

i.e. the HF module name under PEFT's wrapper prefix, weights [out, in] like every torch
Linear. The project's `<module>.lora_a` [d_in, r] and `<module>.lora_b` [r, d_out] are
their transposes, and both scale by alpha / r (`use_rslora: false`), so the update
`scale * lora_a @ lora_b` is PEFT's `scale * (B @ A).T` exactly.

Only what the project trains is accepted: plain LoRA on the projections of `pipeline.lora
.TARGETS`, one rank and alpha for all of them, no DoRA / rsLoRA / biases / extra trained
modules; anything else is refused with the field and what is allowed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from pipeline.lora import A_SUFFIX, B_SUFFIX, TARGETS, LoraConfig, adapter_shapes
from pipeline.tokenizer.hf import HFError
from tpu_jobs.model.hf_checkpoint import hf_name, read_safetensors, write_safetensors

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel.base_model (LoraModel).model (the HF model)
# Our suffix -> PEFT's (its tensors are stored transposed: [out, in] as torch Linear weights).
_SUFFIXES = {A_SUFFIX: ".lora_A.weight", B_SUFFIX: ".lora_B.weight"}
# PEFT's target_modules names the projection by its last path component (`q_proj`).
PEFT_TARGETS: dict[str, str] = {t: path.rsplit(".", 1)[1] for t, path in TARGETS.items()}
# adapter_config.json fields that must hold these values for the adapter to be the plain
# LoRA the project computes (a field absent from an older PEFT's file is its default).
_PLAIN_LORA: dict[str, Any] = {
    "peft_type": "LORA",
    "use_rslora": False,
    "use_dora": False,
    "bias": "none",
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "lora_bias": False,
}


def peft_name(name: str) -> str:
    """PEFT's tensor name of a flat adapter name (`layers.0.mlp.up_proj.lora_a` ->
    `base_model.model.model.layers.0.mlp.up_proj.lora_A.weight`)."""
    for suffix, theirs in _SUFFIXES.items():
        if name.endswith(suffix):
            module = hf_name(name[: -len(suffix)] + ".kernel")[: -len(".weight")]
            return PEFT_PREFIX + module + theirs
    raise HFError(f"{name!r} is not an adapter tensor; allowed: names ending {A_SUFFIX}/{B_SUFFIX}")


def adapters_to_peft(
    adapters: Mapping[str, np.ndarray], dtype: str = "float32"
) -> dict[str, np.ndarray]:
    """{flat adapter name: array} -> PEFT's {name: array} (transposed) in `dtype`."""
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    return {
        peft_name(n): np.ascontiguousarray(np.asarray(a, np.float32).T).astype(np_dtype)
        for n, a in adapters.items()
    }


def peft_config(lora: LoraConfig, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """adapter_config.json of a run's `lora` section: what PEFT and vLLM need to apply it."""
    return {
        **_PLAIN_LORA,
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        # PEFT and vLLM type it int: an integral alpha is written as one.
        "lora_alpha": int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(PEFT_TARGETS[t] for t in lora.targets),
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
        "init_lora_weights": True,
    }


def export_peft(
    out_dir: str | Path,
    lora: LoraConfig,
    adapters: Mapping[str, np.ndarray],
    *,
    base_model_name_or_path: str | None = None,
    dtype: str = "float32",
) -> Path:
    """Write `adapters` (flat names, `pipeline.lora`) as a PEFT adapter directory."""
    if not lora.enabled:
        raise HFError("lora.rank=0: the run trains no adapters; allowed: a run with lora.rank > 0")
    if dtype not in ("float32", "bfloat16"):
        raise HFError(f"dtype={dtype!r} is invalid; allowed: 'float32', 'bfloat16'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / ADAPTER_WEIGHTS_FILE, adapters_to_peft(adapters, dtype))
    config = peft_config(lora, base_model_name_or_path)
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def check_peft_config(config: Mapping[str, Any], lora: LoraConfig) -> None:
    """Raise HFError (one line) unless the adapter is plain LoRA with the run's rank, alpha
    and targets."""
    for key, want in _PLAIN_LORA.items():
        got = config.get(key, want)
        if got != want and not (want in ({}, None) and not got):
            raise HFError(
                f"adapter_config.json has {key}={got!r}; allowed: {want!r} (plain LoRA only)"
            )
    targets = config.get("target_modules")
    by_peft = {v: k for k, v in PEFT_TARGETS.items()}
    if not isinstance(targets, list) or not set(targets) <= set(by_peft):
        raise HFError(
            f"adapter_config.json has target_modules={targets!r}; allowed: a list of "
            f"{', '.join(PEFT_TARGETS.values())}"
        )
    theirs = {"lora.rank": config.get("r"), "lora.alpha": config.get("lora_alpha")}
    theirs["lora.targets"] = sorted(by_peft[t] for t in targets)
    ours = {"lora.rank": lora.rank, "lora.alpha": lora.alpha}
    ours["lora.targets"] = sorted(lora.targets)
    diff = [k for k in ours if ours[k] != theirs[k]]
    if diff:
        raise HFError(
            "the adapter does not match the run's lora section: "
            + ", ".join(f"{k}={ours[k]!r} (adapter: {theirs[k]!r})" for k in diff)
            + "; a new run takes: "
            + " ".join(f"{k}={json.dumps(theirs[k]).replace(' ', '')}" for k in ours)
        )


def load_peft(
    directory: str | Path, lora: LoraConfig, base_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    """The flat float32 adapters of the PEFT adapter at `directory`, for a base whose flat
    tensors have `base_shapes` and a run whose lora section is `lora`. Raises HFError
    (one line) on a config that disagrees with `lora`, or tensors missing, unexpected or
    not shaped for the base."""
    d = Path(directory)
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if not (d / name).is_file():
            raise HFError(
                f"{d / name} not found: a PEFT adapter directory needs {ADAPTER_CONFIG_FILE} "
                f"and {ADAPTER_WEIGHTS_FILE}"
            )
    if not lora.enabled:
        raise HFError(
            "lora.rank=0 but a PEFT adapter was given; allowed: a run with lora.rank > 0 "
            "(and the adapter's lora.alpha and lora.targets)"
        )
    check_peft_config(json.loads((d / ADAPTER_CONFIG_FILE).read_text()), lora)
    tensors = read_safetensors(d / ADAPTER_WEIGHTS_FILE)
    expected = adapter_shapes(base_shapes, lora)
    out: dict[str, np.ndarray] = {}
    missing, misshaped = [], []
    for name, shape in expected.items():
        theirs = peft_name(name)
        if theirs not in tensors:
            missing.append(theirs)
            continue
        arr = np.ascontiguousarray(np.asarray(tensors[theirs], np.float32).T)
        if arr.shape != shape:
            misshaped.append(f"{theirs}: {tuple(tensors[theirs].shape)}, base needs {shape[::-1]}")
            continue
        out[name] = arr
    unexpected = sorted(set(tensors) - {peft_name(n) for n in expected})
    if missing or unexpected or misshaped:
        parts = [
            f"{label} {items[:4]} ({len(items)})"
            for label, items in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("mis-shaped", misshaped),
            )
            if items
        ]
        raise HFError(f"{d / ADAPTER_WEIGHTS_FILE} does not fit the base: " + "; ".join(parts))
    return out
