"""The LM head's logits, and the picked tokens' log-probs and entropy computed from them
in chunks of tokens, so that no [B, T, V] array exists in the forward or the backward pass.

At a real vocabulary the logits dwarf everything else a train step holds: for Qwen2.5
(V = 151,936) at 8 x 2,048 tokens one float32 copy is 9.3 GiB, and the dense computation
keeps several (the logits, the log-softmax, their cotangents). `token_logprobs` flattens
the tokens, pads them to a multiple of `chunk` and maps over the chunks; each chunk's body
(LM head matmul, log-softmax, picked log-prob, entropy) is under `jax.checkpoint`, so the
forward keeps only the chunk's hidden states and the backward recomputes the chunk's
logits instead of storing them. Peak memory of the head is then a few [chunk, V] arrays.
`chunk = 0` (or a chunk that holds every token) is the dense computation, unchanged.

All functions are pure, jit-able and differentiable w.r.t. the hidden states and the
head weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tpu_jobs.model.constraints import constrain
from tpu_jobs.model.matmul import matmul


def head_logits(hidden: jax.Array, weight: jax.Array, *, vocab_major: bool) -> jax.Array:
    """float32 logits [..., V] of hidden states [..., H], computed in hidden's dtype.

    weight: [V, H] when `vocab_major` (a tied embedding), else [H, V] (an lm_head kernel)."""
    w = weight.astype(hidden.dtype)
    return matmul(hidden, w.T if vocab_major else w, jnp.float32)


def _token_stats(
    hidden: jax.Array,
    targets: jax.Array,
    weight: jax.Array,
    temp: jax.Array,
    *,
    vocab_major: bool,
    entropy: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """Dense (log p(target), entropy | None) for hidden [..., H] and targets [...]."""
    logits = head_logits(hidden, weight, vocab_major=vocab_major)
    # On a mesh: every device computes its slice of the vocabulary for all of the tokens
    # (the weight is vocabulary-parallel, tpu_jobs.model.mesh.PARAM_RULES), so a device holds
    # tokens x V / devices logits and the weight is never gathered.
    logits = constrain(logits, *[None] * (logits.ndim - 1), "vocab")
    logp = jax.nn.log_softmax(logits / temp, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1) if entropy else None
    return picked, ent


def token_logprobs(
    hidden: jax.Array,
    targets: jax.Array,
    weight: jax.Array,
    *,
    vocab_major: bool,
    temperature: float | jax.Array = 1.0,
    chunk: int = 0,
    entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """(logp [B, N], entropy [B, N] or None), float32, of the distributions
    softmax(head_logits(hidden) / temperature) (raw logits when temperature <= 0):
    logp[b, n] = log p(targets[b, n]) and entropy[b, n] that distribution's entropy.

    hidden: [B, N, H] (the states that predict `targets` [B, N] int); weight as in
    `head_logits`. `chunk` > 0: at most that many tokens' logits exist at once (see the
    module docstring); 0: all at once (dense)."""
    temp = jnp.asarray(temperature, jnp.float32)
    temp = jnp.where(temp > 0, temp, 1.0)
    stats = functools.partial(_token_stats, vocab_major=vocab_major, entropy=entropy)
    b, n, h = hidden.shape
    total = b * n
    if chunk <= 0 or total <= chunk:
        return stats(hidden, targets, weight, temp)
    steps = -(-total // chunk)
    pad = steps * chunk - total
    # Pad rows are zeros (finite logits, target 0): their results are sliced off.
    flat_h = jnp.pad(hidden.reshape(total, h), ((0, pad), (0, 0))).reshape(steps, chunk, h)
    flat_t = jnp.pad(targets.reshape(total), (0, pad)).reshape(steps, chunk)
    # The weight and temperature are explicit arguments of the checkpointed body (not
    # closed over) so their cotangents flow through the rematerialised chunk; the body
    # saves nothing, and prevent_cse is off as the scan already keeps XLA from merging the
    # recomputation with the forward.
    body = jax.checkpoint(stats, prevent_cse=False)
    # A chunk's hidden states go to every device (a few rows, next to the logits).
    picked, ent = jax.lax.map(
        lambda xs: body(constrain(xs[0], None, None), xs[1], weight, temp), (flat_h, flat_t)
    )

    def unflatten(x: jax.Array) -> jax.Array:
        return x.reshape(steps * chunk)[:total].reshape(b, n)

    return unflatten(picked), None if ent is None else unflatten(ent)
