"""What XLA says a program needs, compiled for abstract inputs and never run.

`train_step_memory` compiles the trainer's whole step (one fused program: forward, loss,
backward, optimizer update) for a run config, LoRA runs included (`lora.rank` > 0: the
adapters and their AdamW state are the trained state; the frozen base, in
`lora.base_dtype`, is an argument beside them, placed like the full model's params);
`sampler_memory` compiles the sampler's generate program. Both take
`jax.ShapeDtypeStruct`s only, so a 7B shape compiles on a laptop. The figures are
`compiled.memory_analysis()`'s: temporaries (the program's own buffers), arguments and
outputs, per device. benchmarks/memory.py tabulates them, and
tests/tpu_jobs/test_memory_guard.py holds the line on the largest temporaries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pipeline.config import RunConfig
from tpu_jobs.learning.step import Learner, StepInputs

# Hugging Face config.json values of Qwen/Qwen2.5-{0.5B,1.5B,7B,32B}, as config overrides
# (`shape_overrides`): the shapes benchmarks/memory.py and benchmarks/accelerator.py use.
QWEN25: dict[str, dict[str, object]] = {
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                 intermediate_size=4864, tie_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                 intermediate_size=8960, tie_embeddings=True),
    "7b": dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
               intermediate_size=18944, tie_embeddings=False),
    "32b": dict(hidden_size=5120, num_layers=64, num_heads=40, num_kv_heads=8,
                intermediate_size=27648, tie_embeddings=False, vocab_size=152_064),
}  # fmt: skip
QWEN25_VOCAB = 151_936  # 0.5B to 14B; 32B and 72B have 152,064 (their `vocab_size` above)
# Qwen/Qwen3-30B-A3B's config.json: every layer a mixture of 128 experts, 8 active.
QWEN3_MOE: dict[str, dict[str, object]] = {
    "30b-a3b": dict(vocab_size=151_936, hidden_size=2048, num_layers=48, num_heads=32,
                    num_kv_heads=4, head_dim=128, intermediate_size=6144, qk_norm=True,
                    tie_embeddings=False, num_experts=128, num_experts_per_tok=8,
                    moe_intermediate_size=768, norm_topk_prob=True, qkv_bias=False),
}  # fmt: skip
# Every shape by name: the Qwen2.5 ones with their default vocabulary and q/k/v biases.
SHAPES: dict[str, dict[str, object]] = {
    **{k: {"vocab_size": QWEN25_VOCAB, **v, "qkv_bias": True} for k, v in QWEN25.items()},
    **QWEN3_MOE,
}


def shape_overrides(shape: str) -> list[str]:
    """Config overrides for a model shape (`SHAPES`) with the byte tokenizer (the
    benchmarks feed random ids, so any tokenizer that fits the vocabulary will do)."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is unknown; allowed: {', '.join(SHAPES)}")
    model = [f"model.{k}={str(v).lower()}" for k, v in SHAPES[shape].items()]
    return [*model, "model.tokenizer=byte"]


def _figures(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
    }


def train_step_memory(
    cfg: RunConfig, prompt_len: int, mesh: jax.sharding.Mesh | None = None
) -> dict[str, int]:
    """memory_analysis() figures of the trainer's fused step for `cfg`: rows =
    rollout.prompts_per_batch * group_size, prompt_len + sampler.max_new_tokens tokens
    each. On one device, or per device of `mesh` (the state placed by the trainer's rules,
    the batch split over data x fsdp x expert, as `Learner` does). With LoRA the arguments are the
    adapters, their optimizer state, the frozen base and the batch."""
    return _figures(compile_train_step(cfg, prompt_len, mesh))


def compile_train_step(
    cfg: RunConfig, prompt_len: int, mesh: jax.sharding.Mesh | None = None
) -> Any:
    """The trainer's fused step for `cfg`, compiled for abstract inputs (see
    `train_step_memory`); its `as_text()` is the partitioned HLO."""
    from tpu_jobs.model import mesh as meshlib

    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, fused_step=True))
    learner = Learner(cfg, prompt_len, abstract=True, mesh=mesh)
    if not learner.fused:
        raise ValueError(
            "train_step_memory compiles the single-update step; allowed: trainer.mini_batches"
            "=1, trainer.epochs=1, trainer.micro_batch=0"
        )
    # Shapes placed on `mesh` by the Learner (abstract): the train state, and the frozen
    # base of a LoRA run (None otherwise) split like the full model's params.
    params, opt_state = learner.template
    frozen = learner.base_template
    r, t, c = learner.rows, prompt_len + learner.completion_len, learner.completion_len

    def sds(shape, dtype):
        sharding = None if mesh is None else meshlib.batch_sharding(mesh, len(shape))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    inp = StepInputs(
        sds((r, t), jnp.int32),
        sds((r, t), jnp.int32),
        sds((r, c), jnp.float32),
        sds((r, c), jnp.float32),
        sds((r,), jnp.float32),
    )
    # The reference of KL terms is the initial policy: a copy of the full params, or
    # (LoRA) the frozen base, which the step reads from `frozen` (`Learner.fused_reference`).
    ref = learner.fused_reference(params["policy"])
    args = (params, opt_state, ref, inp, None, frozen, learner.dropout_key(0))
    with learner.under_mesh():
        return learner._fused_step.lower(*args).compile()


def sampler_memory(
    cfg: RunConfig, batch: int, prompt_len: int, new_tokens: int, *, dtype: str = "float32"
) -> dict[str, int]:
    """memory_analysis() figures of the sampler's generate program (prefill + decode loop)
    for `batch` prompts of `prompt_len` tokens and `new_tokens` new ones (one device); under
    sampler.kv_token_budget, of the program of one part of the call (`rows_per_call`)."""
    from flax import nnx

    from tpu_jobs.generate.static_sampler import StaticSampler
    from tpu_jobs.model.transformer import init_cache, init_model

    sampler = StaticSampler(cfg.model, kv_token_budget=cfg.sampler.kv_token_budget)
    batch = sampler.rows_per_call(batch, prompt_len + new_tokens)  # one program's rows
    graphdef, state = nnx.split(nnx.eval_shape(lambda: init_model(cfg.model, 0)))
    state, weights = sampler.abstract_weights(graphdef, state, dtype)
    total = prompt_len + new_tokens
    cache = jax.eval_shape(lambda: init_cache(cfg.model, batch, total, dtype, per_layer=True))
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    scalars = (jnp.int32(new_tokens), jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0))
    program = sampler.program(graphdef, new_tokens, dtype, False, False)
    compiled = program.lower(state, weights, tokens, tokens, keys, cache, *scalars).compile()
    return _figures(compiled)
