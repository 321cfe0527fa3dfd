"""The sampling interface: what a sampler takes (`SamplingParams`), what it returns
(`SampleResult`) and what it is (`Sampler`), and the settings of each role that samples,
built once from the run config (`sampling_params`, the `ROLES` table).

Who samples with what (docs/evaluation.md, "Sampling settings"):

| role         | max_new_tokens            | temperature          | top_k / top_p     | dtype          |
|--------------|---------------------------|----------------------|-------------------|----------------|
| `rollout`    | sampler.max_new_tokens    | sampler.temperature  | sampler.*         | sampler.dtype  |
| `judge`      | VERDICT_MAX_TOKENS        | sampler.temperature  | sampler.*         | sampler.dtype  |
| `pass_rates` | sampler.max_new_tokens    | sampler.temperature  | sampler.*         | sampler.dtype  |
| `eval`       | sampler.max_new_tokens    | **eval.temperature** | **off** (0 / 1.0) | sampler.dtype  |

The rollout worker's judge groups are rollouts too, so they sample as the solve groups do.
The pass-rate job estimates the difficulty the rollouts will meet, so it samples as they
do (its `--temperature` may override). The evaluator measures the policy's own
distribution at its own temperature: `eval.temperature` overrides `sampler.temperature`,
and `sampler.top_k` / `sampler.top_p` do not apply, so a version's pass@k does not move
when a run changes how its rollouts truncate the distribution (and runs that differ only
there stay comparable). It has been so since the evaluator was written; this table states
it and `sampling_params` enforces it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import jax
import numpy as np

from pipeline.config import RunConfig
from tpu_jobs.model.judge import VERDICT_MAX_TOKENS
from tpu_jobs.model.transformer import DTYPES, Transformer


@dataclass(frozen=True)
class SamplingParams:
    """How one call samples: at most `max_new_tokens` tokens per row, at `temperature`
    (0: greedy), keeping the `top_k` most likely tokens (0: off) and the nucleus of mass
    `top_p` (1.0: off), computing in `dtype` (a name in `tpu_jobs.model.transformer.DTYPES`).
    Refuses a value no sampler takes, naming it and what is allowed."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} is invalid; allowed: > 0")
        if self.temperature < 0:
            raise ValueError(
                f"temperature={self.temperature} is invalid; allowed: >= 0 (0: greedy)"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} is invalid; allowed: >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} is invalid; allowed: (0, 1] (1: off)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid; allowed: {', '.join(DTYPES)}")


@dataclass
class SampleResult:
    """tokens: [B, max_new] int32, PAD after EOS; logprobs: [B, max_new] float32, 0 after
    EOS; lengths: [B] generated tokens including the EOS if any; finished: [B] EOS emitted.

    routing (MoE models, samplers that record it; else None): per row, the experts its
    routers chose for each prompt and generated token, [prompt + lengths[r], layers, k] in
    `pipeline.rollouts.routing_dtype(E)`, E (not recorded) on a token the sampler never
    ran (the last generated one): what the rollout batch's `routing` column carries."""

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray
    routing: list[np.ndarray] | None = None


@runtime_checkable
class Sampler(Protocol):
    """What every sampler of `tpu_jobs.generate.registry.SAMPLERS` is: the static sampler
    (`static_sampler.StaticSampler`), the continuous-batching engine (`engine.Engine`) and
    vLLM (`vllm_sampler.VllmSampler`).

    `generate` samples one completion per prompt (token ids, BOS included), row r with
    `keys[r]` (typed PRNG keys [B] or uint32 key data [B, 2]) and the weights of `model`;
    `pad_id` fills the rows after EOS (`eos_id`)."""

    pad_id: int
    eos_id: int

    def generate(
        self,
        model: Transformer,
        prompts: list[list[int]],
        keys: jax.Array,
        params: SamplingParams,
    ) -> SampleResult: ...


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_seq_len: int) -> int:
    """The number of prompts, refusing no prompts or an empty one (every sampler's contract:
    a row starts from at least one token, BOS), and a prompt whose new tokens would run past
    the model's context: a clear refusal where the sampler would otherwise build a program
    for positions the model was not configured for (a HumanEval prompt of 1,500 characters
    on the demo's 256-token model asked XLA:CPU for 31 GB of prefill attention)."""
    if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    if len(prompts[longest]) + max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt {longest} has {len(prompts[longest])} tokens + max_new_tokens="
            f"{max_new_tokens} > model.max_seq_len={max_seq_len}; allowed: prompt + new "
            "tokens <= model.max_seq_len (raise model.max_seq_len, or use shorter prompts)"
        )
    return len(prompts)


def _rollout(cfg: RunConfig) -> SamplingParams:
    sc = cfg.sampler
    return SamplingParams(
        max_new_tokens=sc.max_new_tokens,
        temperature=sc.temperature,
        top_k=sc.top_k,
        top_p=sc.top_p,
        dtype=sc.dtype,
    )


def _judge(cfg: RunConfig) -> SamplingParams:
    return replace(_rollout(cfg), max_new_tokens=VERDICT_MAX_TOKENS)


def _eval(cfg: RunConfig) -> SamplingParams:
    # The evaluator's policy (module docstring): its own temperature, no truncation.
    return SamplingParams(
        max_new_tokens=cfg.sampler.max_new_tokens,
        temperature=cfg.eval.temperature,
        top_k=0,
        top_p=1.0,
        dtype=cfg.sampler.dtype,
    )


# role -> its sampling settings from the run config (the table of the module docstring).
ROLES: dict[str, Callable[[RunConfig], SamplingParams]] = {
    "rollout": _rollout,
    "judge": _judge,
    "pass_rates": _rollout,
    "eval": _eval,
}


def sampling_params(cfg: RunConfig, role: str) -> SamplingParams:
    """The sampling settings of `role` (a name in ROLES) under run config `cfg`."""
    if role not in ROLES:
        raise ValueError(f"role={role!r} is invalid; allowed: {', '.join(map(repr, ROLES))}")
    return ROLES[role](cfg)
