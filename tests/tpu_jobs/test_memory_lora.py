"""The LoRA train step's arguments, as XLA's `memory_analysis()` counts them, against the
bytes worked out by hand from the model's shapes: the frozen base in bfloat16, the float32
adapters with their two AdamW moments, the optimizer's step counters and the batch; on one
device and per device on 8 fake devices with FSDP (the base split like the full model's
params). The full-RL step of the same shape is worked out the same way, and the LoRA step
must hold a small fraction of its bytes."""

from __future__ import annotations

import json

import pytest

from pipeline.config import load_config
from tests.tpu_jobs.test_mesh import run_on_eight_devices
from tpu_jobs.learning.memory import train_step_memory

# Four small compiles, two of them on 8 fake devices (~30 s on 2 cores): the memory lane.
pytestmark = pytest.mark.memory

# Every matrix dimension a multiple of 8, so FSDP over 8 devices splits each one evenly.
V, H, FF, L, HEADS, KV_HEADS, HEAD_DIM, RANK = 1024, 64, 128, 2, 2, 1, 32, 4
PROMPT, COMPLETION, ROWS = 32, 96, 8
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
OVERRIDES = [
    f"model.vocab_size={V}",
    f"model.hidden_size={H}",
    f"model.intermediate_size={FF}",
    f"model.num_layers={L}",
    f"model.num_heads={HEADS}",
    f"model.num_kv_heads={KV_HEADS}",
    f"model.head_dim={HEAD_DIM}",
    "model.qkv_bias=true",  # vectors, which FSDP leaves whole on every device
    "model.tie_embeddings=false",
    "model.tokenizer=byte",
    f"model.max_seq_len={PROMPT + COMPLETION}",
    f"sampler.max_new_tokens={COMPLETION}",
    "rollout.prompts_per_batch=4",
    "rollout.group_size=2",
    "trainer.algorithm=grpo",  # a KL term: the step takes a reference (LoRA: the base)
]
LORA = [f"lora.rank={RANK}", "lora.base_dtype=bfloat16"]

# The base: matrices (embedding, LM head, projections), which FSDP splits, and vectors
# (q/k/v biases, two norms a layer, the final norm), which it keeps whole.
MATRICES = 2 * V * H + L * (H * Q + 2 * H * KV + Q * H + 3 * H * FF)
VECTORS = L * (Q + 2 * KV + 2 * H) + H
# Adapters on all seven projections: A [d_in, r] and B [r, d_out] each.
ADAPTERS = L * RANK * ((H + Q) + 2 * (H + KV) + (Q + H) + 2 * (H + FF) + (FF + H))
COUNTERS = 2 * 4  # int32 step counts: Adam's and the learning-rate schedule's
T = PROMPT + COMPLETION
BATCH = 2 * ROWS * T * 4 + 2 * ROWS * COMPLETION * 4 + ROWS * 4  # tokens, mask; comp_mask,
# behaviour log-probs; rewards


def expected(lora: bool, devices: int) -> int:
    """Argument bytes per device; on `devices` > 1 the matrices and the batch are split."""
    base = MATRICES // devices + VECTORS
    batch = BATCH // devices
    if lora:  # bf16 base (also the KL reference) + f32 adapters and their Adam moments
        return 2 * base + 3 * 4 * ADAPTERS + COUNTERS + batch
    return 4 * 4 * base + COUNTERS + batch  # f32 params, two moments and the reference


def test_lora_step_arguments_are_the_base_in_bf16_and_the_adapters_adam_state():
    full = train_step_memory(load_config(None, OVERRIDES), PROMPT)["argument_bytes"]
    lora = train_step_memory(load_config(None, [*OVERRIDES, *LORA]), PROMPT)["argument_bytes"]
    assert full == expected(False, 1)
    assert lora == expected(True, 1)
    assert lora < full / 6  # 2 bytes a base weight instead of 16: 0.16 by the sums above


EIGHT = f"""
import json
from pipeline.config import load_config
from tpu_jobs.learning.memory import train_step_memory
from tpu_jobs.model import mesh as M

mesh = M.make_mesh((1, 8, 1))
out = {{}}
for name, extra in (("full", []), ("lora", {LORA!r})):
    cfg = load_config(None, {OVERRIDES!r} + extra)
    out[name] = train_step_memory(cfg, {PROMPT}, mesh)["argument_bytes"]
print("RESULT" + json.dumps(out))
"""


def test_fsdp_splits_the_frozen_base_like_the_full_models_params():
    out = run_on_eight_devices(EIGHT)
    assert out == {"full": expected(False, 8), "lora": expected(True, 8)}, json.dumps(out)
