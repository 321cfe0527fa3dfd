"""Drawing tokens, shared by the static sampler and the engine: the PRNG keys of the rows,
the top-k / top-p filter, the Gumbel noise and one sampling step.

Row r's token at sample index s is argmax(filtered logits + gumbel(fold_in(keys[r], s))),
exactly `jax.random.categorical(fold_in(keys[r], s), filtered)`; so a row's tokens depend
on its own key and prompt only, whichever sampler draws them. Log-probs are those of the
emitted tokens under softmax(logits / temperature) (raw logits when temperature == 0),
before top-k / top-p filtering. Top-p is applied to the top-k-filtered, renormalised
distribution (HF order: temperature, top-k, top-p); tokens tied with the smallest kept
logit are kept.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Up to this many Gumbel noise values (batch x new tokens x vocab) are drawn before the
# decode loop in one go (64 MiB of float32); beyond it, each step draws its own. The values
# are the same either way.
NOISE_BUDGET = 1 << 24


def is_typed_key(keys: Any) -> bool:
    """Typed PRNG keys (jax.random.key), as opposed to raw uint32 key data."""
    return isinstance(keys, jax.Array) and jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)


def key_data(keys: Any) -> np.ndarray:
    """The uint32 key data of typed PRNG keys (any shape; [..., 2] out), or `keys` as it
    is when it is key data already."""
    return np.asarray(jax.random.key_data(keys) if is_typed_key(keys) else keys)


def as_keys(keys: jax.Array, n: int) -> jax.Array:
    """Typed PRNG keys [n] from typed keys [n] or raw uint32 key data [n, 2]."""
    if is_typed_key(keys):
        typed = keys
    else:
        raw = np.asarray(keys)
        if raw.dtype != np.uint32 or raw.ndim != 2:
            raise ValueError(
                f"keys of dtype {raw.dtype} and shape {raw.shape} are invalid; allowed: typed "
                "PRNG keys of shape [B] (jax.random.key) or uint32 key data of shape [B, 2]"
            )
        typed = jax.random.wrap_key_data(jnp.asarray(raw))
    if typed.shape != (n,):
        raise ValueError(
            f"keys must hold one key per prompt: got shape {typed.shape}, expected ({n},)"
        )
    return typed


def filter_logits(
    scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, *, use_top_k: bool, use_top_p: bool
) -> jax.Array:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. scaled: [B, V]."""
    if not (use_top_k or use_top_p):
        return scaled
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)  # [B, V] descending
    threshold = jnp.full(scaled.shape[:-1], -jnp.inf, scaled.dtype)
    if use_top_k:
        k = jnp.clip(top_k, 1, vocab).astype(jnp.int32)
        threshold = jnp.take(desc, k - 1, axis=-1)
        desc = jnp.where(desc >= threshold[:, None], desc, -jnp.inf)
    if use_top_p:
        probs = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        keep = before < top_p
        keep = keep.at[:, 0].set(True)  # the most likely token always survives
        n_keep = jnp.sum(keep, axis=-1)
        threshold = jnp.maximum(threshold, jnp.take_along_axis(desc, n_keep[:, None] - 1, -1)[:, 0])
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def sample_step(
    logits: jax.Array,
    keys: jax.Array,
    step: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    use_top_k: bool,
    use_top_p: bool,
    noise: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(token [B] int32, log-prob [B] float32) from next-token logits [B, V] float32.

    `noise`: this step's Gumbel noise [B, V] as made by `step_noise` (else drawn here);
    either way row r samples argmax(filtered + gumbel(fold_in(keys[r], step))), which is
    exactly `jax.random.categorical(fold_in(keys[r], step), filtered)`."""
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    filtered = filter_logits(scaled, top_k, top_p, use_top_k=use_top_k, use_top_p=use_top_p)
    if noise is None:
        noise = step_noise(keys, jnp.asarray(step, jnp.int32)[None], logits.shape[-1])[:, 0]
    # One argmax for both modes (an argmax is a slow reduction on XLA:CPU).
    token = jnp.argmax(jnp.where(greedy, logits, filtered + noise), axis=-1).astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def step_noise(keys: jax.Array, steps: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise [B, len(steps), vocab] of `jax.random.categorical` for each row key and
    step (float32): gumbel(fold_in(keys[r], steps[j]), (vocab,))."""

    def row(key):
        return jax.vmap(lambda s: jax.random.gumbel(jax.random.fold_in(key, s), (vocab,)))(steps)

    return jax.vmap(row)(keys)
