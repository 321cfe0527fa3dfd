"""The jitted sampler against full-forward references computed outside the sampler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipeline.config import ModelConfig
from tpu_jobs.generate.decode_layouts import DECODE_LAYOUTS
from tpu_jobs.generate.interface import SamplingParams
from tpu_jobs.generate.static_sampler import StaticSampler
from tpu_jobs.model.transformer import flat_params, init_model, load_flat_params, sequence_logprobs

CFG = ModelConfig(preset="tiny", qkv_bias=True, tie_embeddings=False)
PAD, EOS = 0, 2
MAX_NEW = 12
FULL_LEN = 32  # padded length of the reference forward pass (one compile)
PROMPTS = [[1, 5, 9, 13, 4], [1, 7], [1, 20, 30, 40, 50, 60, 21, 22, 23]]
TRIGGERS = (11, 17, 25, 33, 41, 49, 57)  # in test_eos_stops_rows, EOS follows these


def random_model(seed: int, triggers: tuple[int, ...] = (), std: float = 0.25):
    """Random weights with spread-out logits, and EOS wired to the previous token.

    Hidden dim 0 of the residual stream carries +3 (or -3 for `triggers`) straight from the
    embedding: no layer writes to it. The LM head reads it only for EOS, with weight -100,
    so EOS is never produced except right after a trigger token, where it is near-certain.
    """
    model = init_model(CFG, 0)
    rng = np.random.default_rng(seed)
    flat = {}
    for name, value in flat_params(model).items():
        if name.endswith("norm.weight"):
            flat[name] = (1.0 + 0.2 * rng.standard_normal(value.shape)).astype(np.float32)
        else:
            flat[name] = (std * rng.standard_normal(value.shape)).astype(np.float32)
    flat["embed_tokens.embedding"][:, 0] = 3.0
    flat["embed_tokens.embedding"][list(triggers), 0] = -3.0
    for layer in range(CFG.num_layers):
        flat[f"layers.{layer}.self_attn.o_proj.kernel"][:, 0] = 0.0
        flat[f"layers.{layer}.mlp.down_proj.kernel"][:, 0] = 0.0
    flat["norm.weight"][0] = 1.0
    flat["lm_head.kernel"][0, :] = 0.0
    flat["lm_head.kernel"][0, EOS] = -100.0
    load_flat_params(model, flat)
    return model


@pytest.fixture(scope="module")
def model():
    return random_model(seed=0)


@pytest.fixture(scope="module", params=sorted(DECODE_LAYOUTS))
def sampler(request):
    """Every test that takes this fixture runs once per decode layout (tpu_jobs.generate.decode_layouts)."""
    return StaticSampler(CFG, pad_id=PAD, eos_id=EOS, decode_layout=request.param)


@jax.jit(static_argnums=1)
def _forward(params, graphdef, tokens, mask):
    model = nnx.merge(graphdef, params)
    pos = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
    return model(tokens, pos, mask)[0]


def full_logits(model, seq: list[int]) -> np.ndarray:
    """Next-token logits [len(seq), V] of one sequence, from a full (cache-free) forward."""
    graphdef, params = nnx.split(model)
    tokens = np.zeros((1, FULL_LEN), np.int32)
    mask = np.zeros((1, FULL_LEN), np.int32)
    tokens[0, : len(seq)], mask[0, : len(seq)] = seq, 1
    out = _forward(params, graphdef, jnp.asarray(tokens), jnp.asarray(mask))
    return np.asarray(out, np.float64)[0, : len(seq)]


def keys_for(n: int, seed: int = 0) -> jax.Array:
    return jax.random.split(jax.random.key(seed), n)


def check_logprobs(model, prompts, out, temp):
    """Returned log-probs == sequence_logprobs of prompt + completion (right padded)."""
    width = max(len(p) for p in prompts) + out.tokens.shape[1]
    tokens = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(tokens)
    for r, p in enumerate(prompts):
        n = len(p) + int(out.lengths[r])
        tokens[r, :n] = list(p) + out.tokens[r, : out.lengths[r]].tolist()
        mask[r, :n] = 1
    ref = np.asarray(sequence_logprobs(model, jnp.asarray(tokens), jnp.asarray(mask), temp))
    for r, p in enumerate(prompts):
        n = int(out.lengths[r])
        got, want = out.logprobs[r, :n], ref[r, len(p) : len(p) + n]
        assert np.abs(got - want).max() <= 1e-5, (r, got, want)
        assert np.all(out.logprobs[r, n:] == 0)


def test_greedy_and_near_zero_temperature_match_manual_argmax(model, sampler):
    expected = []
    for prompt in PROMPTS:
        seq = list(prompt)
        for _ in range(MAX_NEW):
            seq.append(int(np.argmax(full_logits(model, seq)[-1])))
        expected.append(seq[len(prompt) :])
    expected = np.array(expected)
    assert len(set(expected.ravel().tolist())) >= 4  # not one repeated token
    for temp in (0.0, 1e-4):
        out = sampler.generate(
            model, PROMPTS, keys_for(3), SamplingParams(max_new_tokens=MAX_NEW, temperature=temp)
        )
        np.testing.assert_array_equal(out.tokens, expected)
        assert out.tokens.shape == (3, MAX_NEW) and out.tokens.dtype == np.int32
        assert out.logprobs.dtype == np.float32 and out.lengths.dtype == np.int32
        np.testing.assert_array_equal(out.lengths, [MAX_NEW] * 3)
        assert out.finished.dtype == np.bool_ and not out.finished.any()


def test_prompt_alone_equals_prompt_in_padded_batch(model, sampler):
    alone = sampler.generate(
        model, [PROMPTS[1]], keys_for(1), SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    )
    longer = [[1, *range(3, 40)], PROMPTS[1], [1, 8, 9]]  # prompt bucket 16 -> 64
    batch = sampler.generate(
        model, longer, keys_for(3), SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    )
    np.testing.assert_array_equal(batch.tokens[1], alone.tokens[0])
    np.testing.assert_allclose(batch.logprobs[1], alone.logprobs[0], atol=1e-5, rtol=0)


def test_row_output_depends_only_on_its_key_and_prompt(model, sampler):
    k = keys_for(5, seed=3)
    first = sampler.generate(model, PROMPTS, k[:3], SamplingParams(max_new_tokens=MAX_NEW))
    shuffled = sampler.generate(
        model,
        [PROMPTS[2], [1, 3, 3], PROMPTS[0], [1, 6]],
        k[jnp.array([2, 3, 0, 4])],
        SamplingParams(max_new_tokens=MAX_NEW),
    )
    np.testing.assert_array_equal(first.tokens[0], shuffled.tokens[2])
    np.testing.assert_array_equal(first.tokens[2], shuffled.tokens[0])
    again = sampler.generate(model, PROMPTS, k[:3], SamplingParams(max_new_tokens=MAX_NEW))
    np.testing.assert_array_equal(first.tokens, again.tokens)
    np.testing.assert_array_equal(first.logprobs, again.logprobs)
    other = sampler.generate(
        model, PROMPTS, keys_for(3, seed=4), SamplingParams(max_new_tokens=MAX_NEW)
    )
    assert not np.array_equal(first.tokens, other.tokens)
    # Raw uint32 key data [B, 2] gives the same result as the typed keys it wraps.
    raw = np.asarray(jax.random.key_data(k[:3]))
    assert raw.shape == (3, 2) and raw.dtype == np.uint32
    np.testing.assert_array_equal(
        sampler.generate(model, PROMPTS, raw, SamplingParams(max_new_tokens=MAX_NEW)).tokens,
        first.tokens,
    )


def allowed_set(logits: np.ndarray, temp: float, top_k: int, top_p: float) -> set[int]:
    """NumPy re-derivation: temperature, then top-k, then top-p on the renormalised rest."""
    scaled = logits / temp
    order = np.argsort(-scaled, kind="stable")
    kept = order[:top_k] if top_k > 0 else order
    probs = np.exp(scaled[kept] - scaled[kept].max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    return set(kept[(mass_before < top_p) | (np.arange(len(kept)) == 0)].tolist())


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (0, 0.5), (6, 0.7)])
def test_top_k_top_p_stay_in_allowed_set(model, sampler, top_k, top_p):
    temp = 1.5  # flatten the distribution so the filters matter
    prompts = [PROMPTS[i % 3] + [10 + i] for i in range(8)]
    out = sampler.generate(
        model,
        prompts,
        keys_for(8, seed=5),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=temp, top_k=top_k, top_p=top_p),
    )
    sizes, ranks = [], []
    for row, prompt in enumerate(prompts):
        gen = out.tokens[row].tolist()
        logits = full_logits(model, prompt + gen)
        for t, token in enumerate(gen):
            step_logits = logits[len(prompt) + t - 1]
            allowed = allowed_set(step_logits, temp, top_k, top_p)
            assert token in allowed, (row, t, token, sorted(allowed))
            sizes.append(len(allowed))
            ranks.append(int((step_logits > step_logits[token]).sum()))
    assert 1.5 < np.mean(sizes) < 0.5 * CFG.vocab_size  # the filter bites but is not greedy
    assert max(ranks) >= 1  # not just the argmax
    check_logprobs(model, prompts, out, temp)  # log-probs taken before filtering


@pytest.mark.parametrize("temp", [1.0, 0.6, 0.0])
def test_logprobs_match_sequence_logprobs(model, sampler, temp):
    out = sampler.generate(
        model,
        PROMPTS,
        keys_for(3, seed=6),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=temp),
    )
    check_logprobs(model, PROMPTS, out, temp)
    assert np.all(out.logprobs < 0)


def test_eos_stops_rows(sampler):
    model = random_model(seed=1, triggers=TRIGGERS)
    prompts = [PROMPTS[i % 3] + [30 + i] for i in range(16)]
    out = sampler.generate(
        model, prompts, keys_for(16, seed=7), SamplingParams(max_new_tokens=MAX_NEW)
    )
    for r in range(16):
        gen = out.tokens[r].tolist()
        if EOS in gen:
            e = gen.index(EOS)
            assert gen[e - 1] in TRIGGERS if e > 0 else prompts[r][-1] in TRIGGERS
            assert out.finished[r] and out.lengths[r] == e + 1
            assert all(t == PAD for t in gen[e + 1 :])
            assert np.all(out.logprobs[r, e + 1 :] == 0)
        else:
            assert not out.finished[r] and out.lengths[r] == MAX_NEW
            assert not set(gen[:-1]) & set(TRIGGERS)  # a trigger is always followed by EOS
    finished_early = out.finished & (out.lengths < MAX_NEW)
    assert finished_early.sum() >= 3 and (~out.finished).sum() >= 2
    assert len(set(out.lengths[out.finished].tolist())) >= 2  # rows stop at different steps
    check_logprobs(model, prompts, out, 1.0)

    # Every prompt ends in a trigger: all rows stop at their first token.
    ending = [p + [TRIGGERS[i % len(TRIGGERS)]] for i, p in enumerate(PROMPTS)]
    out = sampler.generate(model, ending, keys_for(3), SamplingParams(max_new_tokens=MAX_NEW))
    np.testing.assert_array_equal(out.lengths, [1, 1, 1])
    assert out.finished.all() and np.all(out.tokens[:, 0] == EOS)
    assert np.all(out.tokens[:, 1:] == PAD) and np.all(out.logprobs[:, 1:] == 0)
    assert np.all(np.abs(out.logprobs[:, 0]) < 1e-3)


def test_compiles_once_per_bucket_and_weights_are_not_baked_in():
    sampler = StaticSampler(CFG, pad_id=PAD, eos_id=EOS, batch_buckets=(4, 8), prompt_buckets=(16,))
    model = random_model(seed=2)
    a = sampler.generate(model, PROMPTS, keys_for(3), SamplingParams(max_new_tokens=MAX_NEW))
    assert sampler.compile_count == 1
    b = sampler.generate(
        model, [*PROMPTS, [1, 4]], keys_for(4), SamplingParams(max_new_tokens=MAX_NEW - 3)
    )
    np.testing.assert_array_equal(b.tokens[:3], a.tokens[:, : MAX_NEW - 3])
    assert b.tokens.shape == (4, MAX_NEW - 3) and np.all(b.lengths == MAX_NEW - 3)
    sampler.generate(
        model, PROMPTS, keys_for(3), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.3)
    )
    assert sampler.compile_count == 1  # other batch size, length, temperature: same program

    load_flat_params(model, flat_params(random_model(seed=3)))  # new weights, in place
    c = sampler.generate(model, PROMPTS, keys_for(3), SamplingParams(max_new_tokens=MAX_NEW))
    assert not np.array_equal(a.tokens, c.tokens)
    other = random_model(seed=2)  # another model object holding the first weights
    d = sampler.generate(
        model=other,
        prompts=PROMPTS,
        keys=keys_for(3),
        params=SamplingParams(max_new_tokens=MAX_NEW),
    )
    np.testing.assert_array_equal(d.tokens, a.tokens)
    sampler.set_weights(other)
    e = sampler.generate(None, PROMPTS, keys_for(3), SamplingParams(max_new_tokens=MAX_NEW))
    np.testing.assert_array_equal(e.tokens, a.tokens)
    assert sampler.compile_count == 1
    sampler.generate(model, [[1, 2]] * 5, keys_for(5), SamplingParams(max_new_tokens=MAX_NEW))
    assert sampler.compile_count == 2  # batch bucket 8


def test_bfloat16_and_argument_errors(model, sampler):
    """bf16 greedy decoding is float32's up to bf16's rounding.

    Why it holds on any CPU: nothing here is a share of agreeing tokens seen on one
    machine. bf16's log-probs are within 32 u (u = 2^-9, bf16's unit roundoff; measured
    8 u) of float32's full forward on the same tokens, and the two choose different tokens
    only where float32's top-2 gap is within the error this test measures (twice the
    largest log-prob error on each side, a factor 2 to spare)."""
    out = sampler.generate(
        model,
        PROMPTS,
        keys_for(3),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0, dtype="bfloat16"),
    )
    ref = sampler.generate(
        model, PROMPTS, keys_for(3), SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    )
    assert out.tokens.shape == (3, MAX_NEW)
    steps = []  # (float32 gap between its choice and bf16's, bf16's log-prob error)
    for r, prompt in enumerate(PROMPTS):
        logits = full_logits(model, prompt + out.tokens[r].tolist())
        for t in range(3):  # while the two agree on the prefix, both see the same history
            step = logits[len(prompt) + t - 1]
            logp = step - step.max() - np.log(np.exp(step - step.max()).sum())
            chosen, f32 = int(out.tokens[r, t]), int(ref.tokens[r, t])
            steps.append((step[f32] - step[chosen], abs(out.logprobs[r, t] - logp[chosen])))
            if chosen != f32:
                break
    gaps, errors = np.array(steps).T
    assert errors.max() < 32 * 2.0**-9, errors.max()
    assert np.all(gaps <= 4 * errors.max()), (gaps, errors)  # 0 where the tokens agree
    with pytest.raises(ValueError, match="non-empty"):
        sampler.generate(model, [[1, 2], []], keys_for(2), SamplingParams(max_new_tokens=4))
    # Past the context: refused by name, not left to build a program for 256+ positions.
    with pytest.raises(ValueError, match=r"prompt 1 has 3 tokens \+ max_new_tokens=254 > model"):
        sampler.generate(model, [[1, 2], [1, 2, 3]], keys_for(2), SamplingParams(254))
    with pytest.raises(ValueError, match="one key per prompt"):
        sampler.generate(model, PROMPTS, keys_for(2), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"uint32 key data of shape \[B, 2\]"):
        sampler.generate(
            model, PROMPTS, np.zeros((3, 2), np.int64), SamplingParams(max_new_tokens=4)
        )
    with pytest.raises(ValueError, match="top_p"):
        sampler.generate(model, PROMPTS, keys_for(3), SamplingParams(max_new_tokens=4, top_p=0.0))
    with pytest.raises(ValueError, match="dtype"):
        sampler.generate(
            model, PROMPTS, keys_for(3), SamplingParams(max_new_tokens=4, dtype="float16")
        )


def test_kv_token_budget_splits_a_call_and_keeps_every_rows_tokens(model):
    """sampler.kv_token_budget: 3 prompts of the 16-token bucket with 12 new tokens (16)
    need 4 x 32 cache slots; a budget of 64 runs them as 2 + 1 rows, with the same tokens
    and log-probs per row as one call. A budget that holds no row is refused."""
    whole = StaticSampler(CFG, pad_id=PAD, eos_id=EOS)
    bounded = StaticSampler(CFG, pad_id=PAD, eos_id=EOS, kv_token_budget=64)
    assert bounded.rows_per_call(3, 32) == 2 and whole.rows_per_call(3, 32) == 3
    k = keys_for(3, seed=7)
    want = whole.generate(model, PROMPTS, k, SamplingParams(max_new_tokens=MAX_NEW))
    got = bounded.generate(model, PROMPTS, k, SamplingParams(max_new_tokens=MAX_NEW))
    assert bounded.compile_count == 2  # a 2-row and a 1-row program
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    tight = StaticSampler(CFG, pad_id=PAD, eos_id=EOS, kv_token_budget=31)
    with pytest.raises(ValueError, match=r"kv_token_budget=31 .* at least 32"):
        tight.generate(model, PROMPTS, k, SamplingParams(max_new_tokens=MAX_NEW))
