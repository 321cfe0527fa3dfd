"""The PPO critic as a value head on the policy's final hidden states, and a forward pass
that returns what the trainer needs from one run of the transformer trunk.

The head is linear: V(s_t) = h_{t-1} . w + b, where h_{t-1} is the final (post-RMSNorm)
hidden state of the prefix that precedes token t (the state in which token t is the
action), as in TRL's `AutoModelForCausalLMWithValueHead`. It shares the trunk with the
policy, so the value loss [c_1 L^VF of PPO] trains the trunk too. Its parameters are a plain
pytree `{"kernel": [hidden, 1], "bias": [1]}`, initialised to zero (V = 0 at the start, no
randomness), and live in the trainer's train state and checkpoint next to the policy.

`hidden_states` re-runs the no-cache path of `tpu_jobs.model.Transformer.__call__` from the
model's own submodules (embedding, layers, final norm) so `model.py` needs no change;
`tests/tpu_jobs/test_trainer.py` checks that `lm_logits(hidden_states(...))` equals the
model's logits exactly, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tpu_jobs.model import DTYPES, Transformer, positions_from_mask, rope_tables

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
    cfg = model.cfg
    cdt = DTYPES[dtype or cfg.dtype]
    tokens = jnp.asarray(tokens)
    mask = jnp.asarray(mask).astype(jnp.int32)
    t = tokens.shape[1]
    x = model.embed_tokens(tokens).astype(cdt)
    cos, sin = rope_tables(positions_from_mask(mask), cfg.head_dim, cfg.rope_theta)
    slots = jnp.arange(t, dtype=jnp.int32)
    visible = (slots[None, None, :] <= slots[None, :, None]) & (mask[:, None, :] > 0)
    for layer in model.layers:
        x, _ = layer(x, cos, sin, visible, None)
    return model.norm(x)


def lm_logits(model: Transformer, hidden: jax.Array) -> jax.Array:
    """The model's LM head (tied embedding or lm_head) on `hidden`; float32 [B, T, V]."""
    if model.lm_head is None:
        logits = hidden @ model.embed_tokens.embedding[...].astype(hidden.dtype).T
    else:
        logits = model.lm_head(hidden)
    return logits.astype(jnp.float32)


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


def policy_forward(
    model: Transformer,
    tokens: jax.Array,
    mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    value_params: ValueParams | None = None,
    *,
    entropy: bool = False,
) -> PolicyOutputs:
    """One trunk pass giving log-probs (as `sequence_logprobs`), optionally the entropy of
    pi(. | prefix) and the values. Jit-able and differentiable."""
    tokens = jnp.asarray(tokens)
    mask = jnp.asarray(mask).astype(jnp.int32)
    hidden = hidden_states(model, tokens, mask)
    logits = lm_logits(model, hidden)
    temp = jnp.asarray(temperature, jnp.float32)
    temp = jnp.where(temp > 0, temp, 1.0)
    logp_all = jax.nn.log_softmax(logits[:, :-1] / temp, axis=-1)
    picked = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
    ent = None
    if entropy:
        ent = _shift(-jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1), mask)
    values = None
    if value_params is not None:
        values = _shift(apply_value_head(value_params, hidden[:, :-1]), mask)
    return PolicyOutputs(_shift(picked, mask), ent, values)


def count_params(tree: Any) -> int:
    return int(sum(x.size for x in jax.tree.leaves(tree)))
