"""The PPO critic as a value head on the policy's final hidden states, and a forward pass
that returns what the trainer needs from one run of the transformer trunk.

The head is linear: V(s_t) = h_{t-1} . w + b, where h_{t-1} is the final (post-RMSNorm)
hidden state of the prefix that precedes token t (the state in which token t is the
action), as in TRL's `AutoModelForCausalLMWithValueHead`. It shares the trunk with the
policy, so the value loss [c_1 L^VF of PPO] trains the trunk too. Its parameters are a plain
pytree `{"kernel": [hidden, 1], "bias": [1]}`, initialised to zero (V = 0 at the start, no
randomness), and live in the trainer's train state and checkpoint next to the policy.

`hidden_states` is the model's own `Transformer.hidden` (the forward without the LM head);
`tests/tpu_jobs/test_trainer.py` checks that `lm_logits(hidden_states(...))` equals the
model's logits exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tpu_jobs.learning.packing import Packing
from tpu_jobs.model.lm_head import token_logprobs
from tpu_jobs.model.moe import RouterOutputs
from tpu_jobs.model.transformer import Transformer, positions_from_mask, token_logprobs_of

ValueParams = dict[str, jax.Array]


def init_value_head(hidden_size: int) -> ValueParams:
    """Zero-initialised head: deterministic, V = 0 until the first update."""
    return {
        "kernel": jnp.zeros((hidden_size, 1), jnp.float32),
        "bias": jnp.zeros((1,), jnp.float32),
    }


def hidden_states(
    model: Transformer, tokens: jax.Array, mask: jax.Array, *, dtype: str | None = None
) -> jax.Array:
    """Final hidden states [B, T, hidden] (after the last RMSNorm), in the compute dtype.

    Same masking and positions as the model (CONVENTIONS.md): query i sees key j iff j <= i
    and mask[j] == 1."""
    mask = jnp.asarray(mask).astype(jnp.int32)
    hidden, _ = model.hidden(jnp.asarray(tokens), positions_from_mask(mask), mask, dtype=dtype)
    return hidden


def lm_logits(model: Transformer, hidden: jax.Array) -> jax.Array:
    """The model's LM head (tied embedding or lm_head) on `hidden`; float32 [B, T, V]."""
    return model.logits(hidden)


def apply_value_head(params: ValueParams, hidden: jax.Array) -> jax.Array:
    """Per-position values [B, T] float32 from hidden states [B, T, hidden]."""
    h = hidden.astype(jnp.float32)
    return (h @ params["kernel"])[..., 0] + params["bias"][0]


class PolicyOutputs(NamedTuple):
    """Per-token arrays [B, T] aligned like `model.sequence_logprobs`: column t belongs to
    token t, computed from the prefix tokens[:, :t]; column 0 and masked tokens are 0.

    logp: log pi(token_t | prefix) under softmax(logits / temperature).
    entropy: exact entropy of that distribution (None unless requested).
    values: V(prefix) from the value head (None without value params).
    """

    logp: jax.Array
    entropy: jax.Array | None
    values: jax.Array | None


def _shift(x: jax.Array, mask: jax.Array) -> jax.Array:
    """[B, T-1] quantities of prefixes -> [B, T] per token (0 at column 0 and on pads)."""
    out = jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)
    return jnp.where(mask > 0, out, 0.0)


def policy_forward_and_router(
    model: Transformer,
    tokens: jax.Array,
    mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    value_params: ValueParams | None = None,
    *,
    entropy: bool = False,
    first: int = 0,
    routing: jax.Array | None = None,
) -> tuple[PolicyOutputs, RouterOutputs | None]:
    """One trunk pass giving log-probs (as `sequence_logprobs`), optionally the entropy of
    pi(. | prefix) and the values, each [B, T - first] (columns first..), and what the MoE
    routers decided (`Transformer.hidden_and_router`; None for a dense model). The LM head
    runs in chunks of `cfg.logits_chunk` tokens (`tpu_jobs.model.lm_head`). Jit-able and
    differentiable. `routing` [B, T, layers, k] (MoE; `tpu_jobs.model.batching.pack_routing`):
    the recorded experts to replay, the mark E where the routers choose."""
    tokens = jnp.asarray(tokens)
    mask = jnp.asarray(mask).astype(jnp.int32)
    if routing is not None:  # row-major as the batch holds it; the model's is layer-major
        routing = jnp.moveaxis(jnp.asarray(routing), 2, 0)
    hidden, router = model.hidden_and_router(
        tokens, positions_from_mask(mask), mask, routing=routing
    )
    logp, ent = token_logprobs_of(
        model, tokens, mask, temperature, first=first, entropy=entropy, hidden=hidden
    )
    values = None
    if value_params is not None:
        values = _shift(apply_value_head(value_params, hidden[:, :-1]), mask)[:, first:]
    return PolicyOutputs(logp, ent, values), router


def packed_policy_forward_and_router(
    model: Transformer,
    packing: Packing,
    completion_mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    value_params: ValueParams | None = None,
    *,
    entropy: bool = False,
) -> tuple[PolicyOutputs, RouterOutputs | None]:
    """`policy_forward_and_router(..., first=T - C)` of a batch [R, T] given packed
    (`tpu_jobs.learning.packing.pack`): the same per-token outputs [R, C] of the completion columns
    (0 where `completion_mask` [R, C] is 0), from one trunk pass over the packed rows.
    Each completion token's log-prob, entropy and value come from the packed hidden state
    just before it, which saw the same prefix at the same positions. The routers' outputs
    are over the packed rows."""
    tokens, segments = jnp.asarray(packing.tokens), jnp.asarray(packing.segments)
    hidden, router = model.hidden_and_router(
        tokens, jnp.asarray(packing.positions), (segments > 0).astype(jnp.int32),
        segments=segments,
    )  # fmt: skip
    rows, cols = jnp.asarray(packing.rows), jnp.asarray(packing.cols)
    h = hidden[rows, cols - 1]  # [R, C, H]: the states that predict the completion tokens
    weight, vocab_major = model.head()
    logp, ent = token_logprobs(
        h,
        tokens[rows, cols],
        weight,
        vocab_major=vocab_major,
        temperature=temperature,
        chunk=model.cfg.logits_chunk,
        entropy=entropy,
    )
    keep = jnp.asarray(completion_mask) > 0

    def masked(x: jax.Array | None) -> jax.Array | None:
        return None if x is None else jnp.where(keep, x, 0.0)

    values = None if value_params is None else apply_value_head(value_params, h)
    return PolicyOutputs(masked(logp), masked(ent), masked(values)), router


def _outputs_only(
    forward: Callable[..., tuple[PolicyOutputs, Any]],
) -> Callable[..., PolicyOutputs]:
    """`forward` (same arguments) returning its PolicyOutputs without the routers'."""

    @functools.wraps(forward)
    def outputs_only(*args: Any, **kwargs: Any) -> PolicyOutputs:
        return forward(*args, **kwargs)[0]

    return outputs_only


# The forwards for callers that need no routers' outputs (every dense model's).
policy_forward = _outputs_only(policy_forward_and_router)
packed_policy_forward = _outputs_only(packed_policy_forward_and_router)


def count_params(tree: Any) -> int:
    return int(sum(x.size for x in jax.tree.leaves(tree)))
