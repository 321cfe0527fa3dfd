"""The regression guard for real vocabularies: the trainer's whole step and the sampler,
compiled (never run) for a 151,936-token vocabulary, must hold no temporary as large as
one float32 [rows, tokens, vocab] array. XLA's own `memory_analysis()` is the judge. The
dense head (model.logits_chunk=0) is compiled too, and must be over the line: without it
the guard could pass for a reason other than the chunking."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from tpu_jobs.learning.memory import sampler_memory, train_step_memory

# Compile-only checks of large programs (~1 min in all): the `memory` lane, run by .ci/run
# after `make test`.
pytestmark = pytest.mark.memory

VOCAB = 151_936  # Qwen2.5's
SMALL_MODEL = [
    f"model.vocab_size={VOCAB}",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=32",
    "model.max_seq_len=1024",
]
PROMPT, COMPLETION, ROWS = 64, 512, 4


def _cfg(*extra: str):
    return load_config(
        None,
        [
            *SMALL_MODEL,
            "model.tokenizer=byte",
            f"sampler.max_new_tokens={COMPLETION}",
            "rollout.prompts_per_batch=2",
            "rollout.group_size=2",
            *extra,
        ],
    )


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_train_step_holds_no_batch_by_tokens_by_vocab_temporary(algorithm):
    one_logits = ROWS * COMPLETION * VOCAB * 4  # f32 [R, C, V]: 1.16 GiB
    # All temporaries together below one such array: none of them is one. (Measured:
    # 0.75 GB at the default logits_chunk=512, whose [512, V] chunk is 0.31 GB.)
    chunked = train_step_memory(_cfg(f"trainer.algorithm={algorithm}"), PROMPT)
    assert chunked["temp_bytes"] < one_logits, chunked
    dense = train_step_memory(
        _cfg(f"trainer.algorithm={algorithm}", "model.logits_chunk=0"), PROMPT
    )
    assert dense["temp_bytes"] > 2 * one_logits, dense  # measured: 4.1x


def test_sampler_prefill_takes_the_head_at_the_last_position_only():
    batch, prompt = 8, 512
    one_logits = batch * prompt * VOCAB * 4  # f32 [B, P, V] of a full prefill: 2.3 GiB
    figures = sampler_memory(_cfg(), batch, prompt, 16)
    assert figures["temp_bytes"] < one_logits / 4, figures  # the [B, V] head, the cache
