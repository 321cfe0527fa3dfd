"""The loss mask of tool episodes: observation tokens sit inside the completion (attended
to) but carry no loss, KL, entropy or statistic.

Hand-built rows with observation gaps mid-sequence and at the end, checked against
independent NumPy references that see only the sampled tokens (ragged rows, no masks):
every one of the eleven algorithm presets (loss and its gradient w.r.t. the log-probs and,
for PPO, the values), the metrics, the trainer's alignment statistics, packing, and SFT.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipeline.algorithms import PRESETS
from pipeline.config import ModelConfig
from tpu_jobs.learning.losses import compute_loss, loss_spec
from tpu_jobs.learning.packing import pack
from tpu_jobs.learning.step import alignment_metrics
from tpu_jobs.learning.value_head import init_value_head, packed_policy_forward, policy_forward
from tpu_jobs.model.batching import pack_rows
from tpu_jobs.model.state import split_model
from tpu_jobs.model.transformer import positions_from_mask
from tpu_jobs.sft import sft_loss

from .random_weights import random_model

# S: a sampled token (loss mask 1), O: an observation token (in the completion, mask 0),
# .: padding. Groups of G = 2 rows; the last group is a dynamic-sampling batch's missing
# group (empty rows, reward 0).
LAYOUT = [
    "SSOOOSSS..",
    "SSSOOSS...",
    "SOOSSSOOS.",
    "SSSSSSSS..",
    "SSSOO.....",  # an episode that ended on an observation (token budget)
    "SOSOSOS...",
    "..........",
    "..........",
]
REWARDS = np.array([1.0, 0.0, 0.5, 1.0, 0.0, 1.0, 0.0, 0.0])
G = 2
MASK = np.array([[c == "S" for c in row] for row in LAYOUT])
IN_COMPLETION = np.array([[c != "." for c in row] for row in LAYOUT])
T = MASK.shape[1]


def _sampled(seed: int) -> dict[str, list[np.ndarray]]:
    """The per-token inputs of the sampled tokens only, row by row (float64)."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list[np.ndarray]] = {k: [] for k in ("new", "old", "ref", "beh", "ent", "v")}
    rows["old_v"] = []
    for m in MASK:
        n = int(m.sum())
        new = -rng.uniform(0.1, 2.5, n)
        rows["new"].append(new)
        rows["old"].append(new + rng.normal(0, 0.3, n))  # some ratios outside the clip
        rows["ref"].append(new + rng.normal(0, 0.5, n))
        rows["beh"].append(new + rng.normal(0, 0.1, n))
        rows["ent"].append(rng.uniform(0.2, 3.0, n))
        old_v = rng.normal(0.3, 0.4, n)
        rows["old_v"].append(old_v)
        rows["v"].append(old_v + rng.normal(0, 0.3, n))
    # A teacher's log-probs (the opd preset), from a stream of their own so the other
    # inputs are those drawn before the preset existed.
    teacher = np.random.default_rng(seed + 1000)
    rows["teacher"] = [np.minimum(o + teacher.normal(0, 0.5, len(o)), 0.0) for o in rows["old"]]
    return rows


def _dense(rows: list[np.ndarray], junk: np.random.Generator | None) -> np.ndarray:
    """[B, T] float32 with the sampled values at the S columns; the masked columns hold
    plausible values (observations: what a model would give there) or, for `junk=None`,
    zeros. Pads hold NaN or inf: masked values must never be read."""
    out = np.zeros(MASK.shape, np.float32)
    if junk is not None:
        out[:] = -junk.uniform(0.0, 9.0, MASK.shape)
        out[~IN_COMPLETION] = junk.choice([np.nan, -np.inf, 1e30], (~IN_COMPLETION).sum())
    for i, r in enumerate(rows):
        out[i, MASK[i]] = r
    return out


# --------------------------------------------------------------------------------------
# NumPy reference: the presets' objectives on ragged rows of sampled tokens
# --------------------------------------------------------------------------------------


def _group_stats(r: np.ndarray):
    g = r.reshape(-1, G)
    rep = lambda x: np.repeat(x, G)  # noqa: E731
    return rep(g.mean(1)), rep(g.std(1)), rep(g.max(1) == g.min(1))


def _token_rewards(spec, rows, i) -> np.ndarray:
    """Terminal reward on the last sampled token, minus beta * (log pi_old - log pi_ref)."""
    n = len(rows["new"][i])
    tr = np.zeros(n)
    if n:
        tr[-1] = REWARDS[i]
    return tr - spec.reward_kl_coef * (rows["old"][i] - rows["ref"][i])


def _whiten(per_row: list[np.ndarray], eps: float) -> list[np.ndarray]:
    flat = np.concatenate(per_row)
    return [(a - flat.mean()) / (flat.std() + eps) for a in per_row]


def np_advantages(spec, rows) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    r, eps, n = REWARDS, spec.adv_eps, [len(x) for x in rows["new"]]
    mean, std, const = _group_stats(r)
    seq = None
    if spec.advantage == "grpo":
        seq = np.where(const, 0.0, (r - mean) / (std + eps))
    elif spec.advantage == "drgrpo":
        seq = np.where(const, 0.0, r - mean)
    elif spec.advantage == "rloo":
        seq = np.where(const, 0.0, r - (mean * G - r) / (G - 1))
    elif spec.advantage == "reinforce":
        seq = r - r.mean() if spec.global_baseline else r
    elif spec.advantage == "reinforce_pp_baseline":
        centred = np.where(const, 0.0, r - mean)
        tok_std = np.concatenate([np.full(k, c) for k, c in zip(n, centred, strict=True)]).std()
        seq = centred / (tok_std + eps)
    if seq is not None:
        return [np.full(k, a) for k, a in zip(n, seq, strict=True)], None
    if spec.advantage == "opd":  # -(log pi_old - log pi_teacher), token by token
        return [t - o for o, t in zip(rows["old"], rows["teacher"], strict=True)], None
    if spec.advantage == "reinforce_pp":
        rets = []
        for i in range(len(n)):
            tr, ret, acc = _token_rewards(spec, rows, i), np.zeros(n[i]), 0.0
            for t in reversed(range(n[i])):
                acc = tr[t] + spec.gamma * acc
                ret[t] = acc
            rets.append(ret)
        return _whiten(rets, eps), None
    assert spec.advantage == "gae"
    advs, rets = [], []
    for i in range(len(n)):
        tr, v = _token_rewards(spec, rows, i), rows["old_v"][i]
        adv, next_v, next_a = np.zeros(n[i]), 0.0, 0.0  # after the last sampled token: terminal
        for t in reversed(range(n[i])):
            next_a = tr[t] + spec.gamma * next_v - v[t] + spec.gamma * spec.lam * next_a
            adv[t], next_v = next_a, v[t]
        advs.append(adv)
        rets.append(adv + v)
    return (_whiten(advs, eps) if spec.whiten_advantages else advs), rets


def np_aggregate(spec, per_row: list[np.ndarray]) -> float:
    nonempty = [x for x in per_row if len(x)]
    if spec.aggregation == "token_mean":
        return float(np.concatenate(per_row).sum() / sum(len(x) for x in per_row))
    if spec.aggregation == "seq_mean_token_mean":
        return float(np.mean([x.mean() for x in nonempty]))
    if spec.aggregation == "seq_mean_token_sum_norm":
        return float(np.mean([x.sum() / (spec.max_len or T) for x in nonempty]))
    assert spec.aggregation == "seq_mean_token_sum"
    return float(np.mean([x.sum() for x in nonempty]))


def np_policy_loss(spec, new, frozen, old, adv) -> np.ndarray:
    """Per-token loss of one row; `frozen` is log pi where the method stops the gradient."""
    lo, hi = 1 - spec.eps_low, 1 + spec.eps_high
    if spec.policy_loss == "ppo_clip":
        ratio = np.exp(new - old)
        return np.maximum(-adv * ratio, -adv * np.clip(ratio, lo, hi))
    if spec.policy_loss == "gspo":  # the sequence ratio: geometric mean over sampled tokens
        s = np.exp(np.mean(new - old)) if len(new) else 1.0
        return np.maximum(-adv * s, -adv * np.clip(s, lo, hi))
    if spec.policy_loss == "cispo":
        return -np.clip(np.exp(frozen - old), lo, hi) * adv * new
    assert spec.policy_loss == "reinforce"
    return -adv * new


def np_kl(name: str, new, ref) -> np.ndarray:
    d = ref - new
    return {"k1": -d, "k2": 0.5 * d**2, "k3": np.exp(d) - d - 1.0}[name]


def np_loss(spec, rows, new_rows, v_rows) -> float:
    """The objective from the sampled tokens alone (`new_rows` / `v_rows` are the variables
    the gradient is taken of; everything that the method holds fixed comes from `rows`)."""
    adv, returns = np_advantages(spec, rows)
    pg = [
        np_policy_loss(spec, new, frozen, old, a)
        for new, frozen, old, a in zip(new_rows, rows["new"], rows["old"], adv, strict=True)
    ]
    if spec.is_correction != "none":  # truncated IS, token level: min(pi_old / pi_beh, C)
        assert (spec.is_correction, spec.is_level) == ("tis", "token")
        pg = [
            x * np.minimum(np.exp(o - b), spec.is_cap)
            for x, o, b in zip(pg, rows["old"], rows["beh"], strict=True)
        ]
    loss = np_aggregate(spec, pg)
    if spec.kl_coef:
        kl = [np_kl(spec.kl_estimator, n, r) for n, r in zip(new_rows, rows["ref"], strict=True)]
        loss += spec.kl_coef * np_aggregate(spec, kl)
    if spec.entropy_coef:
        loss -= spec.entropy_coef * np_aggregate(spec, rows["ent"])
    if spec.vf_coef:
        c = spec.value_clip
        vl = []
        for v, ov, ret in zip(v_rows, rows["old_v"], returns, strict=True):
            clipped = ov + np.clip(v - ov, -c, c)
            vl.append(0.5 * np.maximum((v - ret) ** 2, (clipped - ret) ** 2))
        loss += spec.vf_coef * np_aggregate(spec, vl)
    return loss


def np_grads(spec, rows) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Central finite differences (float64) of `np_loss` w.r.t. each sampled log-prob and
    value."""
    h = 1e-6

    def diff(which: str) -> list[np.ndarray]:
        out = []
        for i, row in enumerate(rows[which]):
            g = np.zeros_like(row)
            for t in range(len(row)):
                vals = []
                for step in (h, -h):
                    bumped = [x.copy() for x in rows[which]]
                    bumped[i][t] += step
                    new_rows = bumped if which == "new" else rows["new"]
                    v_rows = bumped if which == "v" else rows["v"]
                    vals.append(np_loss(spec, rows, new_rows, v_rows))
                g[t] = (vals[0] - vals[1]) / (2 * h)
            out.append(g)
        return out

    return diff("new"), (diff("v") if spec.vf_coef else [])


# --------------------------------------------------------------------------------------
# The eleven presets against the reference
# --------------------------------------------------------------------------------------


def _jax_loss(spec, rows, junk):
    """(loss, metrics, d loss / d logp_new, d loss / d values) from compute_loss on the
    dense [B, T] layout with the observation gaps masked."""
    dense = {k: jnp.asarray(_dense(v, junk)) for k, v in rows.items()}

    def f(logp_new, values):
        return compute_loss(
            spec,
            logp_new,
            dense["old"],
            jnp.asarray(MASK.astype(np.float32)),
            rewards=jnp.asarray(REWARDS, jnp.float32),
            group_size=G,
            logp_ref=dense["ref"],
            logp_behaviour=dense["beh"],
            values=values if spec.vf_coef else None,
            old_values=dense["old_v"],
            entropy=dense["ent"],
            logp_teacher=dense["teacher"] if spec.needs_teacher else None,
        )

    (loss, metrics), (g_new, g_v) = jax.value_and_grad(f, (0, 1), has_aux=True)(
        dense["new"], dense["v"]
    )
    return loss, metrics, np.asarray(g_new), np.asarray(g_v)


ALGORITHMS = sorted(PRESETS)


def test_the_eleven_presets_are_all_here():
    assert len(ALGORITHMS) == 11


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_masked_loss_and_gradients_equal_numpy_on_the_sampled_tokens(algorithm):
    # An entropy bonus on top of the preset, so the entropy term is covered as well.
    spec = loss_spec(algorithm, entropy_coef=0.01)
    rows = _sampled(seed=len(algorithm))
    loss, metrics, g_new, g_v = _jax_loss(spec, rows, np.random.default_rng(1))

    want = np_loss(spec, rows, rows["new"], rows["v"])
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-6)
    want_new, want_v = np_grads(spec, rows)
    np.testing.assert_allclose(g_new[~MASK], 0.0)  # no gradient reaches an observation
    for i in range(len(LAYOUT)):
        np.testing.assert_allclose(g_new[i, MASK[i]], want_new[i], rtol=1e-4, atol=1e-6)
    if spec.vf_coef:
        np.testing.assert_allclose(g_v[~MASK], 0.0)
        for i in range(len(LAYOUT)):
            np.testing.assert_allclose(g_v[i, MASK[i]], want_v[i], rtol=1e-4, atol=1e-6)
    assert float(metrics["num_tokens"]) == MASK.sum()

    # Whatever the masked positions hold (log-probs, reference, behaviour, values,
    # entropy), the loss, the gradients and every metric are the same, bit for bit.
    loss_b, metrics_b, g_new_b, g_v_b = _jax_loss(spec, rows, np.random.default_rng(2))
    assert float(loss_b) == float(loss)
    np.testing.assert_array_equal(g_new_b, g_new)
    np.testing.assert_array_equal(g_v_b, g_v)
    assert {k: float(v) for k, v in metrics_b.items()} == {k: float(v) for k, v in metrics.items()}


def test_kl_entropy_and_ratio_metrics_count_only_the_sampled_tokens():
    spec = loss_spec("grpo", is_correction="tis", is_level="sequence")
    rows = _sampled(seed=7)
    _, metrics, _, _ = _jax_loss(spec, rows, np.random.default_rng(3))
    cat = {k: np.concatenate(v) for k, v in rows.items()}
    lengths = [len(x) for x in rows["new"]]
    mean, std, const = _group_stats(REWARDS)
    adv = np.repeat(np.where(const, 0.0, (REWARDS - mean) / (std + spec.adv_eps)), lengths)
    ratio = np.exp(cat["new"] - cat["old"])
    # Sequence-level IS: the product over the sampled tokens only.
    seq_is = [np.exp(np.sum(o - b)) for o, b in zip(rows["old"], rows["beh"], strict=True)]
    mismatch = cat["old"] - cat["beh"]
    expect = {
        "kl_ref": np.mean(np_kl("k3", cat["new"], cat["ref"])),
        "entropy": np.mean(cat["ent"]),
        "neg_logp_mean": -np.mean(cat["new"]),
        "ratio_mean": np.mean(ratio),
        "ratio_max": np.max(ratio),
        "approx_kl": np.mean(ratio - 1 - np.log(ratio)),
        "clip_frac": np.mean(((ratio < 0.8) & (adv < 0)) | ((ratio > 1.2) & (adv > 0))),
        "adv_std": np.std(adv),
        "is_weight_mean": np.mean(np.repeat(np.minimum(seq_is, spec.is_cap), lengths)),
        "mismatch_kl": np.mean(np.exp(mismatch) - 1 - mismatch),
    }
    for key, want in expect.items():
        assert float(metrics[key]) == pytest.approx(want, rel=1e-5, abs=1e-6), key


def test_alignment_metrics_count_only_the_sampled_tokens():
    rows = _sampled(seed=9)
    got = alignment_metrics(
        jnp.asarray(_dense(rows["old"], np.random.default_rng(4))),
        jnp.asarray(_dense(rows["beh"], np.random.default_rng(5))),
        jnp.asarray(MASK.astype(np.float32)),
        2.0,
    )
    diff = np.concatenate(rows["old"]) - np.concatenate(rows["beh"])
    assert float(got["logprob_absdiff_mean"]) == pytest.approx(np.mean(np.abs(diff)), rel=1e-5)
    assert float(got["logprob_absdiff_max"]) == pytest.approx(np.max(np.abs(diff)), rel=1e-5)
    assert float(got["is_ratio_max"]) == pytest.approx(np.exp(diff).max(), rel=1e-5)
    assert float(got["is_ratio_min"]) == pytest.approx(np.exp(diff).min(), rel=1e-5)


# --------------------------------------------------------------------------------------
# Rows: the loss mask in the trainer's layout; packing; SFT
# --------------------------------------------------------------------------------------


def test_pack_rows_puts_the_loss_mask_into_the_completion_mask_only():
    prompts = [[1, 5, 6], [1, 7]]
    completions = [[8, 9, 10, 11, 12], [13, 14]]
    tokens, mask, comp = pack_rows(prompts, completions, 4, 6, loss_masks=[[1, 0, 0, 1, 1], None])
    np.testing.assert_array_equal(mask[0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 0])  # all attended
    np.testing.assert_array_equal(comp, [[1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match="row 1: loss mask of 3 entries for 2 completion"):
        pack_rows(prompts, completions, 4, 6, loss_masks=[None, [1, 1, 1]])
    with pytest.raises(ValueError, match="1 loss masks for 2 rows"):
        pack_rows(prompts, completions, 4, 6, loss_masks=[None])


TINY = ModelConfig(preset="tiny", vocab_size=64, tie_embeddings=False)


def _episode_rows(vocab: int):
    """Prompts and completions laid out as LAYOUT (tokens random), with the loss masks."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, vocab, rng.integers(1, 5)).tolist() for _ in LAYOUT]
    completions = [
        rng.integers(3, vocab, int(IN_COMPLETION[i].sum())).tolist() for i in range(len(LAYOUT))
    ]
    loss_masks = [MASK[i, : len(c)].astype(int).tolist() for i, c in enumerate(completions)]
    return prompts, completions, loss_masks


@pytest.fixture(scope="module")
def model():
    return random_model(dataclasses.replace(TINY, logits_chunk=7), seed=3)


def test_packed_equals_padded_with_a_loss_mask_and_observations_are_context(model):
    graphdef, params = nnx.split(model)
    p = 4
    prompts, completions, loss_masks = _episode_rows(TINY.vocab_size)
    tokens, mask, comp = pack_rows(prompts, completions, p, T, loss_masks=loss_masks)
    np.testing.assert_array_equal(comp, MASK)
    packing = pack(tokens, mask, completion_len=T)
    assert packing.segments.max() > 1  # rows share a packed row
    value = init_value_head(TINY.hidden_size)
    value = {"kernel": value["kernel"] + 0.1, "bias": value["bias"] + 0.2}

    # As the trainer: both forwards see the attention mask (observations included); only
    # the loss reads the loss mask.
    @jax.jit
    def padded(prm, v, toks):
        return policy_forward(nnx.merge(graphdef, prm), toks, mask, 0.8, v, entropy=True, first=p)

    @jax.jit
    def packed(prm, v):
        return packed_policy_forward(
            nnx.merge(graphdef, prm), packing, mask[:, p:], 0.8, v, entropy=True
        )

    spec = loss_spec("ppo", entropy_coef=0.01)

    def loss(logp, values, entropy):
        return compute_loss(
            spec,
            logp,
            jax.lax.stop_gradient(logp),
            comp,
            rewards=jnp.asarray(REWARDS, jnp.float32),
            group_size=G,
            values=values,
            old_values=jax.lax.stop_gradient(values),
            entropy=entropy,
        )[0]

    want_out = padded(params, value, tokens)
    got_out = packed(params, value)
    for g, w in zip(got_out, want_out, strict=True):  # observations included
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=0)
    # The loss and its cotangents of the model outputs (which the model's backward maps
    # to the same parameter gradients packed or not: tests/tpu_jobs/test_packing.py).
    loss_and_cot = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    want, want_cot = loss_and_cot(*want_out)
    got, got_cot = loss_and_cot(*got_out)
    assert float(got) == pytest.approx(float(want), rel=1e-4, abs=1e-6)
    for g, w in zip(got_cot, want_cot, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4)
        assert np.all(np.asarray(g)[~MASK] == 0)  # nothing flows into an observation's output

    # The observations are in the sequence: the model gives them log-probs (attended to,
    # nothing computed away); the loss just does not read them. Another observation token
    # changes what the later sampled tokens are conditioned on.
    obs = IN_COMPLETION & ~MASK
    assert np.all(np.asarray(got_out.logp)[obs] < 0)
    row, col = 0, 3
    assert LAYOUT[row][col] == "O" and LAYOUT[row][col + 2] == "S"
    other = tokens.copy()
    other[row, p + col] = (other[row, p + col] + 1) % TINY.vocab_size
    moved = padded(params, value, other).logp
    assert abs(float(moved[row, col + 2]) - float(want_out.logp[row, col + 2])) > 1e-4


def test_sft_with_a_mask_trains_only_the_unmasked_targets(model):
    fns, params = split_model(model)
    p = 4
    prompts, completions, loss_masks = _episode_rows(TINY.vocab_size)
    tokens, mask, comp = pack_rows(prompts, completions, p, T, loss_masks=loss_masks)
    loss = jax.jit(lambda c: sft_loss(fns, params, tokens, mask, c, p))
    got = float(loss(comp))

    # Reference: full-vocabulary logits of the whole sequence (observations in the input),
    # log-softmax in NumPy, the NLL of the sampled targets only, averaged over them.
    @jax.jit
    def full_logits(prm):
        m = fns.merge(prm)
        hidden, _ = m.hidden(jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)), mask)
        return m.logits(hidden)

    logits = np.asarray(full_logits(params), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    rows, cols = np.nonzero(MASK)
    cols = cols + p
    want = -np.mean(logp[rows, cols - 1, tokens[rows, cols]])
    assert got == pytest.approx(want, rel=1e-5)
    # Without the mask the observation tokens would be targets too: another loss.
    _, _, all_ones = pack_rows(prompts, completions, p, T)
    assert float(loss(all_ones)) != pytest.approx(got)
