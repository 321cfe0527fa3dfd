"""LoRA adapters: the run's `lora` section, which projections carry an adapter, the names
of adapter tensors, and the merge of adapters into base weights (pure NumPy).

The contract every role shares (trainer, rollout worker, evaluator, parameter server, HF
import/export): a target projection whose base kernel is the flat tensor
`<module>.kernel`, shaped [d_in, d_out] (HF's weight transposed), carries two tensors

    <module>.lora_a  [d_in, rank]     initialised random (scaled), trained
    <module>.lora_b  [rank, d_out]    initialised to zero, trained

and the effective kernel is `kernel + scale * lora_a @ lora_b` with `scale = alpha / rank`
(PEFT's default, `use_rslora=False`). With `lora_b = 0` the adapted model equals its base,
so version 0 of a LoRA run is the base itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from pipeline.errors import check as _check

# target name (what `lora.targets` lists) -> the module path of the projection in a layer.
TARGETS: dict[str, str] = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
BASE_DTYPES = ("float32", "bfloat16")
MAX_RANK = 4096
A_SUFFIX = ".lora_a"
B_SUFFIX = ".lora_b"


@dataclass(frozen=True)
class LoraConfig:
    """LoRA on the attention and MLP projections; `rank: 0` (the default) is full RL.

    alpha: the adapter's scale is alpha / rank (PEFT's convention), so changing the rank
    at a fixed alpha keeps the initial update's size comparable.
    targets: which projections of every layer carry an adapter (keys of `TARGETS`).
    dropout: on the adapter's input during training only (0 = off).
    base_dtype: the frozen base's storage dtype in the trainer (bfloat16 halves it).
    """

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(TARGETS)
    dropout: float = 0.0
    base_dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        _check(0 <= self.rank <= MAX_RANK, "lora.rank", self.rank, f"0 (off) .. {MAX_RANK}")
        _check(self.alpha > 0, "lora.alpha", self.alpha, "> 0")
        _check(
            bool(self.targets)
            and set(self.targets) <= set(TARGETS)
            and len(set(self.targets)) == len(self.targets),
            "lora.targets",
            list(self.targets),
            f"a non-empty list without repeats of {', '.join(TARGETS)}",
        )
        _check(0.0 <= self.dropout < 1.0, "lora.dropout", self.dropout, "in [0, 1)")
        _check(
            self.base_dtype in BASE_DTYPES,
            "lora.base_dtype",
            self.base_dtype,
            " or ".join(BASE_DTYPES),
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def target_modules(base_names: Iterable[str], targets: Iterable[str]) -> list[str]:
    """The module paths (`layers.3.self_attn.q_proj`) of the base's flat tensor names that
    carry an adapter, in sorted order."""
    paths = tuple(TARGETS[t] for t in targets)
    out = []
    for name in base_names:
        if name.endswith(".kernel"):
            module = name[: -len(".kernel")]
            if module.startswith("layers.") and module.split(".", 2)[2] in paths:
                out.append(module)
    return sorted(out)


def adapter_shapes(
    base_shapes: Mapping[str, tuple[int, ...]], cfg: LoraConfig
) -> dict[str, tuple[int, int]]:
    """Every adapter tensor's name and shape for a base with these flat tensor shapes."""
    shapes: dict[str, tuple[int, int]] = {}
    for module in target_modules(base_shapes, cfg.targets):
        d_in, d_out = base_shapes[module + ".kernel"]
        shapes[module + A_SUFFIX] = (d_in, cfg.rank)
        shapes[module + B_SUFFIX] = (cfg.rank, d_out)
    return shapes


def is_adapter(name: str) -> bool:
    return name.endswith(A_SUFFIX) or name.endswith(B_SUFFIX)


def merge(
    base: Mapping[str, np.ndarray], adapters: Mapping[str, np.ndarray], scale: float
) -> dict[str, np.ndarray]:
    """The base's flat tensors with every adapter folded into its kernel:
    `kernel + scale * lora_a @ lora_b`, computed in float32 and stored in the kernel's
    dtype. Every adapter must name a kernel of the base, in pairs."""
    modules = sorted({n[: -len(A_SUFFIX)] for n in adapters if n.endswith(A_SUFFIX)})
    b_modules = sorted({n[: -len(B_SUFFIX)] for n in adapters if n.endswith(B_SUFFIX)})
    if modules != b_modules or len(adapters) != 2 * len(modules):
        raise ValueError(
            "adapters must come in lora_a/lora_b pairs; unpaired: "
            f"{sorted(set(modules) ^ set(b_modules)) or sorted(set(adapters))[:4]}"
        )
    out = dict(base)
    for module in modules:
        key = module + ".kernel"
        if key not in base:
            raise ValueError(f"adapter {module!r} has no base kernel {key!r}")
        kernel = base[key]
        delta = adapters[module + A_SUFFIX].astype(np.float32) @ adapters[module + B_SUFFIX].astype(
            np.float32
        )
        if delta.shape != kernel.shape:
            raise ValueError(
                f"adapter {module!r} gives a {delta.shape} update for a {kernel.shape} kernel"
            )
        out[key] = (kernel.astype(np.float32) + np.float32(scale) * delta).astype(kernel.dtype)
    return out


def split_adapters(
    flat: Mapping[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the base's tensors, the adapter tensors) of flat tensors that may hold both (a
    model's parameters or a version with adapters); the adapters are empty for full RL."""
    base = {k: v for k, v in flat.items() if not is_adapter(k)}
    return base, {k: v for k, v in flat.items() if is_adapter(k)}
