"""Sequence packing: the layout against a hand-built one, and the packed forward (log-probs,
entropy, values and their gradients) against the unpacked one on a random model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipeline.config import ModelConfig
from tpu_jobs.learning.packing import buckets, first_fit_decreasing, pack
from tpu_jobs.learning.value_head import init_value_head, packed_policy_forward, policy_forward
from tpu_jobs.model.batching import pack_rows

from .random_weights import random_model

TINY = ModelConfig(preset="tiny", vocab_size=64, tie_embeddings=False)


def test_layout_equals_a_hand_built_one():
    # Four rows of P=3 prompt + C=3 completion columns; real lengths 5, 2, 3, 4.
    prompts = [[1, 2], [3], [4, 5, 6], [7, 8]]
    completions = [[11, 12, 13], [14], [], [15, 16]]
    tokens, mask, _ = pack_rows(prompts, completions, 3, 3)
    packing = pack(tokens, mask, completion_len=3)
    # First fit decreasing into rows of 6: row 0 (5) -> bin 0; row 3 (4) -> bin 1;
    # row 2 (3) -> bin 2 (bin 1 has room 2); row 1 (2) -> bin 1. Buckets of 4 rows:
    # 1, 2, 4: three bins take the bucket of 4.
    assert first_fit_decreasing(mask.sum(1), 6) == [[0], [3, 1], [2]]
    assert buckets(4) == (1, 2, 4) and buckets(16, multiple=4) == (4, 8, 16)
    np.testing.assert_array_equal(
        packing.tokens,
        [[1, 2, 11, 12, 13, 0], [7, 8, 15, 16, 3, 14], [4, 5, 6, 0, 0, 0], [0] * 6],
    )
    np.testing.assert_array_equal(
        packing.segments,
        [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 2, 2], [1, 1, 1, 0, 0, 0], [0] * 6],
    )
    np.testing.assert_array_equal(
        packing.positions,
        [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 0], [0] * 6],
    )
    # Completion token c of row r sits at (rows, cols); padding points at (0, 1).
    np.testing.assert_array_equal(packing.rows, [[0, 0, 0], [1, 0, 0], [0, 0, 0], [1, 1, 0]])
    np.testing.assert_array_equal(packing.cols, [[2, 3, 4], [5, 1, 1], [1, 1, 1], [2, 3, 1]])


def test_a_row_longer_than_a_packed_row_is_refused():
    with pytest.raises(ValueError, match="row 1 has 7 tokens; a packed row holds 6"):
        first_fit_decreasing(np.array([3, 7]), 6)


def _ragged_batch(rng, rows, p, c, vocab):
    prompts = [rng.integers(3, vocab, rng.integers(1, p + 1)).tolist() for _ in range(rows)]
    completions = [rng.integers(3, vocab, rng.integers(0, c + 1)).tolist() for _ in range(rows)]
    completions[-1] = []  # a missing group's empty row
    return pack_rows(prompts, completions, p, c)


def test_packed_forward_equals_unpacked_in_values_and_gradients():
    cfg = dataclasses.replace(TINY, tie_embeddings=True, logits_chunk=7)
    model = random_model(cfg, seed=3)
    graphdef, params = nnx.split(model)
    p, c = 5, 9
    tokens, mask, comp_mask = _ragged_batch(np.random.default_rng(4), 8, p, c, cfg.vocab_size)
    packing = pack(tokens, mask, completion_len=c)
    assert packing.tokens.shape[0] < tokens.shape[0]  # the point of packing
    value = init_value_head(cfg.hidden_size)
    value = {"kernel": value["kernel"] + 0.1, "bias": value["bias"] + 0.2}

    def loss(forward, prm, v):
        out = forward(nnx.merge(graphdef, prm), v)
        total = jnp.sum(out.logp * 1.3) + 0.3 * jnp.sum(out.entropy) + jnp.sum(out.values)
        return total, out

    def unpacked(m, v):
        return policy_forward(m, tokens, mask, 0.8, v, entropy=True, first=p)

    def packed(m, v):
        return packed_policy_forward(m, packing, mask[:, p:], 0.8, v, entropy=True)

    results = []
    for forward in (unpacked, packed):
        grad = jax.value_and_grad(lambda prm, v, f=forward: loss(f, prm, v), (0, 1), has_aux=True)
        (_, out), grads = grad(params, value)
        results.append((out, grads))
    (want, want_grads), (got, got_grads) = results
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=0)
    assert np.all(np.asarray(got.logp)[comp_mask == 0] == 0)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4)
