"""The sampler of a run by name (`sampler.engine`): every job that samples (rollout
worker, evaluator, pass-rate job) builds it here (through `tpu_jobs.generate.policy`), so
they all generate the same way. Each is a `tpu_jobs.generate.interface.Sampler`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from pipeline.config import SAMPLER_ENGINES, RunConfig
from pipeline.tokenizer import Tokenizer
from tpu_jobs.generate.engine import Engine
from tpu_jobs.generate.interface import Sampler
from tpu_jobs.generate.static_sampler import StaticSampler
from tpu_jobs.generate.vllm_sampler import VllmSampler


def _static(cfg: RunConfig, tok: Tokenizer, mesh: jax.sharding.Mesh | None) -> StaticSampler:
    return StaticSampler(
        cfg.model,
        pad_id=tok.pad_id,
        eos_id=tok.eos_id,
        mesh=mesh,
        kv_token_budget=cfg.sampler.kv_token_budget,
    )


def _engine(cfg: RunConfig, tok: Tokenizer, mesh: jax.sharding.Mesh | None) -> Engine:
    sc = cfg.sampler
    return Engine(
        cfg.model,
        pad_id=tok.pad_id,
        eos_id=tok.eos_id,
        max_slots=sc.slots,
        kv_tokens=sc.kv_token_budget or None,
        page_size=sc.page_size,
        chunk=sc.decode_chunk,
        detokenize=tok.decode,
        mesh=mesh,
    )


def _vllm(cfg: RunConfig, tok: Tokenizer, mesh: jax.sharding.Mesh | None) -> VllmSampler:
    # RunConfig refuses mesh.sampler with vllm: vLLM places the model itself.
    sc = cfg.sampler
    return VllmSampler(
        cfg.model,
        pad_id=tok.pad_id,
        eos_id=tok.eos_id,
        dtype=sc.dtype,
        max_slots=sc.slots,
        kv_token_budget=sc.kv_token_budget,
        python=sc.vllm_python,
        args=sc.vllm_args,
        lora=cfg.lora,
        weight_transfer=sc.vllm_weight_transfer,
    )


# sampler.engine -> (run config, tokenizer, sampler mesh or None) -> a sampler.
SAMPLERS: dict[str, Callable[[RunConfig, Tokenizer, jax.sharding.Mesh | None], Sampler]] = {
    "jax": _engine,
    "static": _static,
    "vllm": _vllm,
}
assert set(SAMPLERS) == set(SAMPLER_ENGINES), "pipeline.config.SAMPLER_ENGINES is out of date"


def make_sampler(cfg: RunConfig, tok: Tokenizer, mesh: jax.sharding.Mesh | None = None) -> Sampler:
    """The sampler `cfg.sampler.engine` names, for `tok`'s special ids, on `mesh`."""
    return SAMPLERS[cfg.sampler.engine](cfg, tok, mesh)
