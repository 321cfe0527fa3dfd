"""RL losses against independent NumPy re-derivations and hand-computed numbers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.config import ConfigError
from tpu_jobs.learning import losses as L

# --------------------------------------------------------------------------------------
# NumPy references (written from the papers' formulas, independently of the module)
# --------------------------------------------------------------------------------------


def np_group_adv(r, G, kind, eps=1e-6):
    out = np.zeros(len(r))
    for s in range(0, len(r), G):
        g = np.asarray(r[s : s + G], np.float64)
        if np.all(g == g[0]):
            continue  # constant group: zero advantage
        if kind == "grpo":
            out[s : s + G] = (g - g.mean()) / (g.std(ddof=0) + eps)
        elif kind == "drgrpo":
            out[s : s + G] = g - g.mean()
        elif kind == "rloo":
            out[s : s + G] = [g[i] - np.delete(g, i).mean() for i in range(G)]
    return out


def np_token_rewards(r, mask, kl=None, beta=0.0):
    B, T = mask.shape
    tr = np.zeros((B, T))
    for i in range(B):
        idx = np.nonzero(mask[i])[0]
        if len(idx):
            tr[i, idx[-1]] = r[i]
        if kl is not None:
            tr[i, idx] -= beta * kl[i, idx]
    return tr


def np_returns(tr, mask, gamma):
    out = np.zeros_like(tr)
    for i in range(tr.shape[0]):
        g = 0.0
        for t in reversed(np.nonzero(mask[i])[0]):
            g = tr[i, t] + gamma * g
            out[i, t] = g
    return out


def np_gae(tr, values, mask, gamma, lam):
    adv = np.zeros_like(tr)
    for i in range(tr.shape[0]):
        idx = np.nonzero(mask[i])[0]
        next_v, next_a = 0.0, 0.0
        for t in reversed(idx):
            delta = tr[i, t] + gamma * next_v - values[i, t]
            next_a = delta + gamma * lam * next_a
            next_v = values[i, t]
            adv[i, t] = next_a
    return adv, (adv + values) * mask


def np_whiten(x, mask, eps=1e-6, center=True):
    v = x[mask > 0]
    mean = v.mean() if center else 0.0
    std = np.sqrt(np.mean((v - v.mean()) ** 2))
    return np.where(mask > 0, (x - mean) / (std + eps), 0.0)


def np_ppo(lp, lo, A, mask, el, eh, c=0.0):
    r = np.exp(lp - lo)
    loss = np.maximum(-A * r, -A * np.clip(r, 1 - el, 1 + eh))
    if c:
        loss = np.where(A < 0, np.minimum(loss, -c * A), loss)
    return loss * mask


def np_seq_mean_token_mean(x, mask):
    rows = [x[i][mask[i] > 0].mean() for i in range(len(x)) if mask[i].sum()]
    return float(np.mean(rows))


def np_token_mean(x, mask):
    return float((x * mask).sum() / mask.sum())


def np_kl(lp, lref, kind):
    log_r = lref - lp
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - 1 - log_r}[kind]


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(b, np.float64), atol=tol, rtol=tol
    )


# --------------------------------------------------------------------------------------
# Fixtures: hand-built inputs
# --------------------------------------------------------------------------------------

# Rows are [prompt pad..., completion..., pad...]; row 4 is fully masked.
MASK = np.array(
    [
        [1, 1, 1, 1, 1, 1],
        [0, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
    ],
    np.float32,
)
REWARDS = np.array([1.0, 0.0, 0.5, 0.1, 0.1, 0.1], np.float32)  # G=3: 2nd group constant
G = 3


def _logps(seed=0, scale=0.3):
    rng = np.random.default_rng(seed)
    lo = -rng.uniform(0.2, 3.0, MASK.shape).astype(np.float32)
    lp = (lo + scale * rng.normal(size=MASK.shape)).astype(np.float32)
    return lp, lo


def _teacher(lo, seed=0):
    """A teacher's log-probs of the sampled tokens: pi_old's moved by up to +-1 nat (so the
    distillation advantage takes both signs), still <= 0."""
    shift = np.random.default_rng(seed + 100).uniform(-1.0, 1.0, lo.shape)
    return np.minimum(lo + shift, -1e-3).astype(np.float32)


# --------------------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_group_advantages_match_numpy(kind):
    res = L.ADVANTAGES[kind](REWARDS, MASK, group_size=G, eps=1e-6)
    ref = np_group_adv(REWARDS, G, kind)
    close(res.advantages, ref[:, None] * MASK)
    assert res.returns is None
    # The constant group (0.1, 0.1, 0.1: inexact in binary) is exactly zero.
    assert np.all(np.asarray(res.advantages)[3:] == 0.0)
    assert float(res.metrics["frac_constant_groups"]) == pytest.approx(0.5)


def test_grpo_std_is_population_std():
    r = np.array([0.0, 1.0], np.float32)
    adv = L.grpo_advantages(r, np.ones((2, 1)), group_size=2, eps=0.0).advantages
    close(adv[:, 0], [-1.0, 1.0])  # ddof=0: std = 0.5; ddof=1 would give +-0.707


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo", "reinforce_pp_baseline"])
def test_group_ids_path_matches_contiguous(kind):
    perm = np.array([4, 0, 2, 5, 1, 3])
    gid = np.repeat(np.arange(2), G)
    contiguous = L.ADVANTAGES[kind](REWARDS, MASK, group_size=G).advantages
    shuffled = L.ADVANTAGES[kind](REWARDS[perm], MASK[perm], group_ids=gid[perm]).advantages
    close(shuffled, np.asarray(contiguous)[perm])


def test_single_sample_per_group():
    r = np.array([1.0, 0.0, 0.3], np.float32)
    m = np.ones((3, 2), np.float32)
    for kind in ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline"):
        adv = L.ADVANTAGES[kind](r, m, group_size=1).advantages
        assert np.all(np.asarray(adv) == 0.0), kind


def test_group_size_validation():
    with pytest.raises(ValueError, match="group_size=4"):
        L.grpo_advantages(REWARDS, MASK, group_size=4)


def test_reinforce_advantages():
    close(L.reinforce_advantages(REWARDS, MASK).advantages, REWARDS[:, None] * MASK)
    res = L.reinforce_advantages(REWARDS, MASK, global_baseline=True)
    close(res.advantages, (REWARDS - REWARDS.mean())[:, None] * MASK)


def test_reinforce_pp_matches_numpy():
    lp, lo = _logps(1)
    lref = lo - 0.2 * np.abs(np.random.default_rng(2).normal(size=MASK.shape)).astype(np.float32)
    mask = MASK.copy()
    mask[0, 2] = 0  # a gap inside a completion is skipped
    beta, gamma = 0.05, 0.9
    res = L.reinforce_pp_advantages(
        REWARDS, mask, logp_old=lo, logp_ref=lref, reward_kl_coef=beta, gamma=gamma, eps=1e-6
    )
    tr = np_token_rewards(REWARDS, mask, kl=lo - lref, beta=beta)
    ref = np_whiten(np_returns(tr, mask, gamma), mask)
    close(res.advantages, ref, tol=1e-4)
    close(res.metrics["reward_kl"], (lo - lref)[mask > 0].mean())


def test_reinforce_pp_baseline_matches_numpy():
    res = L.reinforce_pp_baseline_advantages(REWARDS, MASK, group_size=G, eps=1e-6)
    centred = np_group_adv(REWARDS, G, "drgrpo")[:, None] * MASK
    close(res.advantages, np_whiten(centred, MASK, center=False), tol=1e-4)


def test_gae_matches_numpy():
    rng = np.random.default_rng(3)
    values = rng.normal(size=MASK.shape).astype(np.float32)
    lp, lo = _logps(4)
    lref = lo + 0.1
    gamma, lam, beta = 0.95, 0.8, 0.1
    res = L.gae_advantages(
        REWARDS,
        MASK,
        values=values,
        logp_old=lo,
        logp_ref=lref,
        reward_kl_coef=beta,
        gamma=gamma,
        lam=lam,
        whiten=False,
    )
    tr = np_token_rewards(REWARDS, MASK, kl=lo - lref, beta=beta)
    adv, ret = np_gae(tr, values, MASK, gamma, lam)
    close(res.advantages, adv, tol=1e-5)
    close(res.returns, ret, tol=1e-5)
    whitened = L.gae_advantages(REWARDS, MASK, values=values, gamma=gamma, lam=lam, whiten=True)
    adv0, ret0 = np_gae(np_token_rewards(REWARDS, MASK), values, MASK, gamma, lam)
    close(whitened.advantages, np_whiten(adv0, MASK), tol=1e-4)
    close(whitened.returns, ret0)


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    values = np.random.default_rng(5).normal(size=MASK.shape).astype(np.float32)
    res = L.gae_advantages(REWARDS, MASK, values=values, gamma=1.0, lam=1.0, whiten=False)
    close(res.advantages, (REWARDS[:, None] - values) * MASK)


# --------------------------------------------------------------------------------------
# Policy losses
# --------------------------------------------------------------------------------------


def _adv_tokens():
    return np_group_adv(REWARDS, G, "grpo")[:, None] * MASK


@pytest.mark.parametrize(("el", "eh", "c"), [(0.2, 0.2, 0.0), (0.2, 0.28, 0.0), (0.1, 0.3, 3.0)])
def test_ppo_clip_matches_numpy(el, eh, c):
    lp, lo = _logps(6, scale=0.5)
    A = _adv_tokens()
    per_tok, m = L.ppo_clip_loss(lp, lo, A, MASK, eps_low=el, eps_high=eh, dual_clip=c)
    close(per_tok, np_ppo(lp, lo, A, MASK, el, eh, c))
    r = np.exp(lp - lo)
    sel = MASK > 0
    close(m["ratio_mean"], r[sel].mean())
    close(m["ratio_max"], r[sel].max())
    close(m["ratio_min"], r[sel].min())
    close(m["approx_kl"], (r - 1 - np.log(r))[sel].mean())
    close(m["clip_frac_low"], ((r < 1 - el) & (A < 0))[sel].mean())
    close(m["clip_frac_high"], ((r > 1 + eh) & (A > 0))[sel].mean())


def test_ppo_clip_bounds_fractions_and_zero_gradients():
    # One row, four tokens: ratio e^{+0.5} and e^{-0.5}, with A = +1 and A = -1.
    lo = np.zeros((1, 4), np.float32)
    lp = np.array([[0.5, -0.5, 0.5, -0.5]], np.float32)
    A = np.array([[1.0, -1.0, -1.0, 1.0]], np.float32)
    mask = np.ones((1, 4), np.float32)

    def f(x):
        per_tok, m = L.ppo_clip_loss(x, lo, A, mask, eps_low=0.2, eps_high=0.28)
        return L.token_mean(per_tok, mask), m

    (loss, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    # Token 0: r = 1.65 > 1.28 with A > 0 -> clipped high; token 1: r = 0.61 < 0.8 with
    # A < 0 -> clipped low; tokens 2, 3: the unclipped branch is the pessimistic one.
    assert float(m["clip_frac_high"]) == pytest.approx(0.25)
    assert float(m["clip_frac_low"]) == pytest.approx(0.25)
    g = np.asarray(g)[0]
    assert g[0] == 0.0 and g[1] == 0.0
    close(g[2], np.exp(0.5) / 4)  # d/dx of -A e^x / 4 with A = -1
    close(g[3], -np.exp(-0.5) / 4)
    close(loss, np.mean([-1.28, 0.8, np.exp(0.5), -np.exp(-0.5)]))


def test_dual_clip_bounds_negative_advantage_loss():
    lo = np.zeros((1, 2), np.float32)
    lp = np.array([[np.log(10.0), np.log(2.0)]], np.float32)
    A = -np.ones((1, 2), np.float32)
    mask = np.ones((1, 2), np.float32)

    def f(x):
        return L.ppo_clip_loss(x, lo, A, mask, dual_clip=3.0)

    per_tok, m = f(jnp.asarray(lp))
    close(per_tok, [[3.0, 2.0]])  # min(10, 3) and min(2, 3)
    assert float(m["dual_clip_frac"]) == pytest.approx(0.5)
    g = jax.grad(lambda x: f(x)[0].sum())(jnp.asarray(lp))
    close(g, [[0.0, 2.0]])


def test_gspo_matches_numpy_value_and_gradient():
    _, lo = _logps(7)
    # Per-token noise with zero mean over each row's real tokens, plus a row shift that sets
    # the sequence ratio: row 0 (A > 0) clipped high, row 1 (A < 0) inside the range.
    noise = np.random.default_rng(7).normal(scale=0.05, size=MASK.shape) * MASK
    noise -= MASK * noise.sum(1, keepdims=True) / np.maximum(MASK.sum(1, keepdims=True), 1)
    shift = np.array([0.01, 0.001, -0.002, 0.0, 0.0, 0.0])[:, None]
    lp = (lo + noise + shift).astype(np.float32)
    A_seq = np_group_adv(REWARDS, G, "grpo")
    el, eh = 3e-3, 4e-3

    def f(x):
        per_tok, m = L.gspo_loss(x, lo, A_seq, MASK, eps_low=el, eps_high=eh)
        return L.seq_mean_token_mean(per_tok, MASK), (per_tok, m)

    (loss, (per_tok, m)), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    nonempty = MASK.sum(1) > 0
    n_seq = nonempty.sum()
    lens = np.maximum(MASK.sum(1), 1)
    s = np.exp(((lp - lo) * MASK).sum(1) / lens)
    seq_loss = np.maximum(-A_seq * s, -A_seq * np.clip(s, 1 - el, 1 + eh))
    close(loss, seq_loss[nonempty].mean())
    close(per_tok, seq_loss[:, None] * MASK)
    # GSPO gradient: d/dlp_{i,t} of -A_i s_i / N = -A_i s_i / (|y_i| N), zero if clipped.
    clipped = ((s > 1 + eh) & (A_seq > 0)) | ((s < 1 - el) & (A_seq < 0))
    grad_ref = np.where(clipped, 0.0, -A_seq * s / lens / n_seq)[:, None] * MASK
    close(g, grad_ref)
    tok_clipped = np.broadcast_to(clipped[:, None], MASK.shape)[MASK > 0]
    close(m["clip_frac"], tok_clipped.mean())
    assert clipped.tolist() == [True, False, False, False, False, False]
    close(m["clip_frac_high"], 6 / MASK.sum())


def test_cispo_matches_numpy_value_and_gradient():
    lp, lo = _logps(8, scale=0.5)
    A = _adv_tokens()
    el, eh = 1.0, 0.28

    def f(x):
        per_tok, m = L.cispo_loss(x, lo, A, MASK, eps_low=el, eps_high=eh)
        return L.token_mean(per_tok, MASK), (per_tok, m)

    (loss, (per_tok, m)), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    w = np.clip(np.exp(lp - lo), 1 - el, 1 + eh)
    close(per_tok, -w * A * lp * MASK)
    close(loss, (-w * A * lp * MASK).sum() / MASK.sum())
    # The IS weight is stop-gradient: gradient = -w A / N_tokens on every token, clipped too.
    close(g, -w * A * MASK / MASK.sum())
    close(m["clip_frac_high"], (np.exp(lp - lo) > 1 + eh)[MASK > 0].mean())
    assert float(m["clip_frac_high"]) > 0 and float(m["clip_frac_low"]) == 0


def test_reinforce_loss_with_tis_weight():
    lp, lo = _logps(9)
    lb = lo + np.random.default_rng(10).normal(scale=0.5, size=MASK.shape).astype(np.float32)
    A = _adv_tokens()
    w = L.tis_weight(lo, lb, 1.5, MASK)
    w_ref = np.minimum(np.exp(lo - lb), 1.5) * MASK
    close(np.asarray(w) * MASK, w_ref)
    per_tok, _ = L.reinforce_loss(lp, lo, A, MASK, is_weight=w)
    close(per_tok, -w_ref * A * lp)
    g = jax.grad(lambda x: L.reinforce_loss(x, lo, A, MASK, is_weight=w)[0].sum())(lp)
    close(g, -w_ref * A)


def test_tis_and_masked_is_sequence_level():
    lo = np.array([[-1.0, -1.0, 0.0], [-1.0, -2.0, 0.0]], np.float32)
    lb = np.array([[-1.5, -1.0, 9.0], [-1.0, -1.0, 9.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 0]], np.float32)
    seq_rho = np.exp([0.5, -1.0])
    tis = L.tis_weight(lo, lb, 1.5, mask, level="sequence")
    close(np.asarray(tis)[:, 0], np.minimum(seq_rho, 1.5))
    mis = L.masked_is_weight(lo, lb, 1.5, mask, level="sequence")
    close(np.asarray(mis)[:, 0], [0.0, seq_rho[1]])  # e^0.5 = 1.65 > 1.5 -> dropped
    tok = L.masked_is_weight(lo, lb, 1.5, mask)
    close(np.asarray(tok) * mask, np.where(np.exp(lo - lb) <= 1.5, np.exp(lo - lb), 0) * mask)


def test_clipped_value_loss_matches_numpy():
    rng = np.random.default_rng(11)
    v, v_old, ret = (rng.normal(size=MASK.shape).astype(np.float32) for _ in range(3))
    per_tok, m = L.clipped_value_loss(v, v_old, ret, MASK, clip=0.2)
    vc = v_old + np.clip(v - v_old, -0.2, 0.2)
    ref = 0.5 * np.maximum((v - ret) ** 2, (vc - ret) ** 2) * MASK
    close(per_tok, ref)
    close(m["vf_clip_frac"], (((vc - ret) ** 2) > ((v - ret) ** 2))[MASK > 0].mean())


# --------------------------------------------------------------------------------------
# Aggregations and KL estimators
# --------------------------------------------------------------------------------------


def test_aggregations_hand_computed():
    # Sequence A: 4 tokens of loss 1; sequence B: 1 token of loss 3; max_len 4.
    x = np.array([[1, 1, 1, 1], [3, 0, 0, 0]], np.float32)
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    assert float(L.seq_mean_token_mean(x, mask)) == pytest.approx((1 + 3) / 2)  # 2.0
    assert float(L.token_mean(x, mask)) == pytest.approx((4 + 3) / 5)  # 1.4
    assert float(L.seq_mean_token_sum_norm(x, mask)) == pytest.approx((4 / 4 + 3 / 4) / 2)
    assert float(L.seq_mean_token_sum_norm(x, mask, max_len=8)) == pytest.approx(
        (4 / 8 + 3 / 8) / 2
    )
    assert float(L.seq_mean_token_sum(x, mask)) == pytest.approx((4 + 3) / 2)
    # An explicit denominator (micro-batching): sum over sequences / norm.
    assert float(L.seq_mean_token_mean(x, mask, norm=4.0)) == pytest.approx(4 / 4)
    assert float(L.token_mean(x, mask, norm=10.0)) == pytest.approx(0.7)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_numpy(kind):
    lp, lref = _logps(12, scale=1.0)
    close(L.KL_ESTIMATORS[kind](lp, lref), np_kl(lp.astype(np.float64), lref, kind), tol=1e-5)


def test_k3_nonnegative_and_unbiased():
    rng = np.random.default_rng(13)
    x = rng.normal(scale=3.0, size=10_000).astype(np.float32)
    assert np.all(np.asarray(L.kl_k3(x, -x)) >= 0)
    assert np.all(np.asarray(L.kl_k3(x, x + 1e-7)) >= 0)
    # Two categoricals: E_{x~p}[k1] = E[k3] = KL(p || q) exactly (enumerate the support).
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.5, 0.3])
    kl = np.sum(p * np.log(p / q))
    for kind in ("k1", "k3"):
        est = np.sum(p * np.asarray(L.KL_ESTIMATORS[kind](np.log(p), np.log(q)), np.float64))
        assert est == pytest.approx(kl, rel=1e-5)


# --------------------------------------------------------------------------------------
# The composed objective
# --------------------------------------------------------------------------------------


def _inputs(alg, seed=0):
    lp, lo = _logps(seed)
    kw = dict(rewards=REWARDS, group_size=G, logp_ref=lo - 0.1)
    if alg == "ppo":
        v = np.random.default_rng(seed + 1).normal(size=MASK.shape).astype(np.float32)
        kw.update(values=v + 0.05, old_values=v)
    spec = L.ALGORITHMS[alg]
    if spec.needs_teacher:  # the opd preset: a teacher's log-probs, and TIS's sampler's
        kw["logp_teacher"] = _teacher(lo, seed)
    if spec.is_correction != "none":
        kw["logp_behaviour"] = (lo + 0.2).astype(np.float32)
    return lp, lo, kw


def test_compute_loss_grpo_matches_numpy():
    lp, lo, kw = _inputs("grpo")
    loss, m = L.compute_loss(L.ALGORITHMS["grpo"], lp, lo, MASK, **kw)
    A = _adv_tokens()
    pg = np_seq_mean_token_mean(np_ppo(lp, lo, A, MASK, 0.2, 0.2), MASK)
    kl = np_seq_mean_token_mean(np_kl(lp, kw["logp_ref"], "k3") * MASK, MASK)
    close(loss, pg + 0.04 * kl)
    close(m["pg_loss"], pg)
    close(m["kl_loss"], kl)


def test_compute_loss_dapo_and_drgrpo_aggregate_differently():
    lp, lo, kw = _inputs("dapo", seed=2)
    A = _adv_tokens()
    loss, _ = L.compute_loss(L.ALGORITHMS["dapo"], lp, lo, MASK, **kw)
    close(loss, np_token_mean(np_ppo(lp, lo, A, MASK, 0.2, 0.28), MASK))
    loss, _ = L.compute_loss(L.ALGORITHMS["drgrpo"], lp, lo, MASK, **kw)
    A_dr = np_group_adv(REWARDS, G, "drgrpo")[:, None] * MASK
    per_tok = np_ppo(lp, lo, A_dr, MASK, 0.2, 0.2)
    nonempty = MASK.sum(1) > 0
    close(loss, (per_tok.sum(1) / MASK.shape[1])[nonempty].mean())


@pytest.mark.parametrize("alg", ["grpo", "dapo"])
def test_row_weights_scale_each_rows_loss(alg):
    """trainer.judge_loss_weight's row weights: each row's per-token losses (policy and KL)
    times its weight, aggregated with the unweighted denominators (GRPO: nonempty rows;
    DAPO: tokens)."""
    lp, lo, kw = _inputs(alg, seed=3)
    w = np.where(np.arange(len(REWARDS)) % 3 == 0, 0.1, 1.0).astype(np.float32)
    spec = L.ALGORITHMS[alg]
    loss, m = L.compute_loss(spec, lp, lo, MASK, row_weight=w, **kw)
    A = _adv_tokens()
    pg_tok = np_ppo(lp, lo, A, MASK, spec.eps_low, spec.eps_high) * w[:, None]
    kl_tok = np_kl(lp, kw["logp_ref"], "k3") * MASK * w[:, None]
    if alg == "grpo":
        nonempty = MASK.sum(1) > 0
        pg = ((pg_tok.sum(1) / np.maximum(MASK.sum(1), 1))[nonempty]).sum() / nonempty.sum()
        kl = ((kl_tok.sum(1) / np.maximum(MASK.sum(1), 1))[nonempty]).sum() / nonempty.sum()
    else:
        pg, kl = pg_tok.sum() / MASK.sum(), kl_tok.sum() / MASK.sum()
    close(m["pg_loss"], pg)
    close(loss, pg + spec.kl_coef * kl)
    unweighted, _ = L.compute_loss(spec, lp, lo, MASK, **kw)
    ones, _ = L.compute_loss(spec, lp, lo, MASK, row_weight=np.ones_like(w), **kw)
    assert float(ones) == float(unweighted)  # weight 1 changes no bit
    assert abs(float(loss) - float(unweighted)) > 1e-4  # the weights act


def test_compute_loss_ppo_with_value_loss():
    lp, lo, kw = _inputs("ppo")
    spec = L.ALGORITHMS["ppo"]
    loss, m = L.compute_loss(spec, lp, lo, MASK, **kw)
    adv, ret = np_gae(np_token_rewards(REWARDS, MASK), kw["old_values"], MASK, 1.0, 0.95)
    A = np_whiten(adv, MASK)
    pg = np_token_mean(np_ppo(lp, lo, A, MASK, 0.2, 0.2), MASK)
    vc = kw["old_values"] + np.clip(kw["values"] - kw["old_values"], -0.2, 0.2)
    vl = 0.5 * np.maximum((kw["values"] - ret) ** 2, (vc - ret) ** 2)
    close(loss, pg + 0.5 * np_token_mean(vl, MASK), tol=1e-4)
    close(m["vf_loss"], np_token_mean(vl, MASK), tol=1e-4)


@pytest.mark.parametrize("alg", sorted(L.ALGORITHMS))
def test_fully_masked_rows_contribute_nothing(alg):
    spec = L.ALGORITHMS[alg]
    lp, lo, kw = _inputs(alg, seed=3)
    # A batch of the first group only (batch-normalised advantages use real tokens only)...
    keep = np.array([0, 1, 2])
    base_kw = {
        k: (v[keep] if isinstance(v, np.ndarray) and v.shape[0] == 6 else v) for k, v in kw.items()
    }
    base_kw["group_size"] = 3
    base = jax.value_and_grad(
        lambda x: L.compute_loss(spec, x, lo[keep], MASK[keep], **base_kw)[0]
    )(jnp.asarray(lp[keep]))
    # ...then append a group of three fully masked rows whose pads hold garbage.
    junk = np.full((3, MASK.shape[1]), np.nan, np.float32)
    big_kw = {
        k: (
            np.concatenate([v, junk if v.ndim == 2 else np.zeros(3, np.float32)])
            if isinstance(v, np.ndarray) and v.shape[0] == 3
            else v
        )
        for k, v in base_kw.items()
    }
    big_kw["logp_ref"] = np.concatenate([base_kw["logp_ref"], np.full_like(junk, -np.inf)])
    big_mask = np.concatenate([MASK[keep], np.zeros_like(junk)])
    big_lp = jnp.asarray(np.concatenate([lp[keep], np.full_like(junk, np.inf)]))
    big_lo = np.concatenate([lo[keep], junk])
    loss, grad = jax.value_and_grad(
        lambda x: L.compute_loss(spec, x, big_lo, big_mask, **big_kw)[0]
    )(big_lp)
    close(loss, base[0], tol=1e-5)
    close(np.asarray(grad)[:3], base[1], tol=1e-5)
    assert np.all(np.asarray(grad)[3:] == 0.0)
    _, metrics = L.compute_loss(spec, big_lp, big_lo, big_mask, **big_kw)
    for name, value in metrics.items():
        assert np.isfinite(float(value)), name


@pytest.mark.parametrize("alg", sorted(L.ALGORITHMS))
def test_all_masked_batch_is_finite(alg):
    spec = L.ALGORITHMS[alg]
    lp, lo, kw = _inputs(alg)
    zero = np.zeros_like(MASK)
    loss, grad = jax.value_and_grad(lambda x: L.compute_loss(spec, x, lo, zero, **kw)[0])(
        jnp.asarray(lp)
    )
    assert float(loss) == 0.0
    assert np.all(np.asarray(grad) == 0.0)
    _, metrics = L.compute_loss(spec, lp, lo, zero, **kw)
    assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("alg", ["grpo", "dapo", "drgrpo", "rloo", "gspo", "cispo"])
def test_constant_group_gets_zero_gradient(alg):
    spec = L.ALGORITHMS[alg].replace(kl_coef=0.0)
    if alg == "gspo":  # the paper's 3e-4 range would clip every sequence of this input
        spec = spec.replace(eps_low=0.5, eps_high=0.5)
    lp, lo, kw = _inputs(alg, seed=4)
    grad = jax.grad(lambda x: L.compute_loss(spec, x, lo, MASK, **kw)[0])(jnp.asarray(lp))
    grad = np.asarray(grad)
    assert np.all(grad[3:] == 0.0)  # rewards (0.1, 0.1, 0.1)
    assert np.any(grad[:3] != 0.0)


def _finite_difference(f, x, h=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        g[idx] = (f(x + e) - f(x - e)) / (2 * h)
    return g


@pytest.mark.parametrize("alg", ["grpo", "ppo"])
def test_gradient_matches_finite_differences(alg):
    with jax.enable_x64(True):
        lp, lo, kw = _inputs(alg, seed=5)
        lp, lo = lp.astype(np.float64), lo.astype(np.float64)
        kw = {k: (v.astype(np.float64) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
        spec = L.ALGORITHMS[alg].replace(eps_low=0.1, eps_high=0.15, kl_coef=0.05)
        # Make sure no ratio sits within h of a clip boundary (kinks).
        r = np.exp(lp - lo)
        for b in (0.9, 1.15):
            assert np.all(np.abs(r - b) > 1e-4)

        def f(x):
            return L.compute_loss(spec, x, lo, MASK, **kw)[0]

        grad = np.asarray(jax.grad(f)(jnp.asarray(lp)))
        f_jit = jax.jit(f)
        fd = _finite_difference(lambda x: float(f_jit(jnp.asarray(x))), lp)
        np.testing.assert_allclose(grad, fd, atol=1e-6)
        clipped = L.compute_loss(spec, lp, lo, MASK, **kw)[1]["clip_frac"]
        assert float(clipped) > 0  # the check covers clipped tokens too


def test_compute_loss_jits_with_static_spec_and_advantages_input():
    lp, lo, kw = _inputs("grpo")
    spec = L.loss_spec("grpo", kl_coef=0.0)
    f = jax.jit(L.compute_loss, static_argnums=0, static_argnames=("group_size",))
    loss_jit, _ = f(spec, lp, lo, MASK, rewards=REWARDS, group_size=G)
    adv = L.compute_advantages(spec, REWARDS, MASK, group_size=G).advantages
    loss_adv, m = L.compute_loss(spec, lp, lo, MASK, advantages=adv)
    seq_adv = np_group_adv(REWARDS, G, "grpo").astype(np.float32)
    loss_seq, _ = L.compute_loss(spec, lp, lo, MASK, advantages=seq_adv)
    close(loss_jit, loss_adv)
    close(loss_seq, loss_adv)
    assert "adv_mean" not in m  # advantages came from outside


def test_compute_loss_with_tis_and_entropy():
    lp, lo, kw = _inputs("grpo", seed=6)
    lb = lo + 0.3
    ent = np.abs(lp)
    spec = L.loss_spec("grpo", is_correction="tis", is_cap=1.2, entropy_coef=0.01)
    loss, m = L.compute_loss(spec, lp, lo, MASK, logp_behaviour=lb, entropy=ent, **kw)
    w = np.minimum(np.exp(lo - lb), 1.2)
    A = _adv_tokens()
    pg = np_seq_mean_token_mean(np_ppo(lp, lo, A, MASK, 0.2, 0.2) * w, MASK)
    kl = np_seq_mean_token_mean(np_kl(lp, kw["logp_ref"], "k3") * MASK, MASK)
    close(loss, pg + 0.04 * kl - 0.01 * np_seq_mean_token_mean(ent, MASK))
    close(m["is_weight_mean"], w[MASK > 0].mean())
    close(m["entropy"], ent[MASK > 0].mean())
    with pytest.raises(ValueError, match="logp_behaviour"):
        L.compute_loss(spec, lp, lo, MASK, entropy=ent, **kw)
    with pytest.raises(ValueError, match="entropy"):
        L.compute_loss(spec, lp, lo, MASK, logp_behaviour=lb, **kw)


def test_loss_spec_presets_and_validation():
    assert set(L.ALGORITHMS) == {
        "grpo",
        "drgrpo",
        "dapo",
        "rloo",
        "reinforce",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "ppo",
        "gspo",
        "cispo",
        "opd",
    }
    assert L.ALGORITHMS["dapo"].eps_high == 0.28
    assert L.ALGORITHMS["grpo"].kl_coef == 0.04
    hash(L.ALGORITHMS["grpo"])  # usable as a static jit argument
    with pytest.raises(ConfigError, match="loss.advantage='nope'"):
        L.LossSpec(advantage="nope")
    with pytest.raises(ConfigError, match="loss.dual_clip"):
        L.LossSpec(dual_clip=0.5)
    with pytest.raises(ConfigError, match="unknown LossSpec field"):
        L.loss_spec("grpo", clip=0.3)
    with pytest.raises(ConfigError, match="algorithm='x'"):
        L.loss_spec("x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        L.ALGORITHMS["grpo"].kl_coef = 1.0  # type: ignore[misc]


# --------------------------------------------------------------------------------------
# On-policy distillation: the opd preset and the mixed mode (distill_coef)
# --------------------------------------------------------------------------------------

# MASK with holes in the loss masks of rows 0 and 2 (tool observations between sampled
# turns); row 4 stays fully masked (a padding row), row 5 has one sampled token.
OPD_MASK = MASK.copy()
OPD_MASK[0, 2:4] = 0
OPD_MASK[2] = [1, 0, 1, 0, 0, 1]


def _opd_inputs(seed=11):
    """(lp, lo, lb, lt) with NaN/inf garbage on every masked token, which must not leak."""
    lp, lo = _logps(seed, scale=0.4)
    lb = (lo + np.random.default_rng(seed + 1).normal(scale=0.5, size=lo.shape)).astype(np.float32)
    lt = _teacher(lo, seed)
    off = OPD_MASK == 0
    lo, lb, lt = (np.where(off, np.nan, x).astype(np.float32) for x in (lo, lb, lt))
    lp = np.where(off, np.inf, lp).astype(np.float32)
    return lp, lo, lb, lt


def np_reverse_kl(lo, lt, mask):
    return float(np.mean((lo - lt)[mask > 0]))


def check_distill_metrics(m, want, lo, lt):
    """reverse_kl and the advantage statistics of the advantage `want` on sampled tokens."""
    on = OPD_MASK > 0
    close(m["reverse_kl"], np_reverse_kl(lo, lt, OPD_MASK))
    for name, stat in (("mean", np.mean), ("std", np.std), ("max", np.max), ("min", np.min)):
        close(m[f"adv_{name}"], stat(want[on]))


def np_opd_loss(lp, lo, lb, lt, mask, el, eh, cap):
    """The opd preset from its definition: A = -(log pi_old - log pi_teacher) per sampled
    token, PPO clip on r = pi / pi_old, times the TIS weight min(pi_old / pi_sampler, C),
    token mean. Also d loss / d log pi (the unclipped branch's -A r w / N, 0 where the clip
    is the max)."""
    on = mask > 0
    lp, lo, lb, lt = (np.where(on, x, 0.0).astype(np.float64) for x in (lp, lo, lb, lt))
    A = np.where(on, -(lo - lt), 0.0)
    r = np.exp(lp - lo)
    w = np.minimum(np.exp(lo - lb), cap)
    unclipped, clipped = -A * r, -A * np.clip(r, 1 - el, 1 + eh)
    n = mask.sum()
    loss = (np.maximum(unclipped, clipped) * w * on).sum() / n
    grad = np.where(on & (unclipped >= clipped), -A * r * w, 0.0) / n
    return loss, grad, A


def test_opd_advantage_is_minus_the_log_ratio_to_the_teacher_on_sampled_tokens():
    _, lo, _, lt = _opd_inputs()
    res = L.compute_advantages(L.ALGORITHMS["opd"], REWARDS, OPD_MASK, logp_old=lo, logp_teacher=lt)
    on = OPD_MASK > 0
    want = np.where(on, np.where(on, lt, 0.0) - np.where(on, lo, 0.0), 0.0)
    close(res.advantages, want)
    assert np.all(np.asarray(res.advantages)[~on] == 0.0)  # NaN pads gave exact zeros
    assert res.returns is None
    m = res.metrics
    check_distill_metrics(m, want, lo, lt)
    close(m["reward_mean"], REWARDS.mean())  # reported, not used
    other = L.compute_advantages(
        L.ALGORITHMS["opd"], REWARDS[::-1].copy(), OPD_MASK, logp_old=lo, logp_teacher=lt
    )
    np.testing.assert_array_equal(np.asarray(other.advantages), np.asarray(res.advantages))


def test_opd_preset_loss_and_gradient_match_numpy():
    spec = L.ALGORITHMS["opd"]
    assert (spec.aggregation, spec.is_correction, spec.policy_loss) == (
        "token_mean",
        "tis",
        "ppo_clip",
    )
    lp, lo, lb, lt = _opd_inputs()

    def f(x):
        return L.compute_loss(
            spec,
            x,
            lo,
            OPD_MASK,
            rewards=REWARDS,
            group_size=G,
            logp_behaviour=lb,
            logp_teacher=lt,
        )

    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    want, want_grad, _ = np_opd_loss(
        lp, lo, lb, lt, OPD_MASK, spec.eps_low, spec.eps_high, spec.is_cap
    )
    close(loss, want)
    close(m["pg_loss"], want)
    close(grad, want_grad)
    assert float(m["clip_frac"]) > 0  # the inputs exercise the clip...
    w = np.minimum(np.exp(lo - lb), spec.is_cap)[OPD_MASK > 0]
    assert (w == spec.is_cap).any() and (w < 1).any()  # ...and both sides of the TIS cap
    close(m["is_weight_mean"], w.mean())
    close(m["reverse_kl"], np_reverse_kl(lo, lt, OPD_MASK))
    close(m["num_tokens"], OPD_MASK.sum())


def test_opd_at_the_teacher_has_zero_advantage_and_zero_gradient():
    lp, lo, lb, _ = _opd_inputs(seed=12)
    spec = L.ALGORITHMS["opd"]
    loss, grad = jax.value_and_grad(
        lambda x: L.compute_loss(
            spec, x, lo, OPD_MASK, rewards=REWARDS, logp_behaviour=lb, logp_teacher=lo
        )[0]
    )(jnp.asarray(lp))
    assert float(loss) == 0.0
    assert np.all(np.asarray(grad) == 0.0)


def test_mixed_mode_adds_coef_times_the_distillation_advantage_to_grpo():
    lp, lo, lb, lt = _opd_inputs(seed=13)
    lref = np.where(OPD_MASK > 0, lo - 0.1, np.nan).astype(np.float32)
    spec = L.ALGORITHMS["grpo"].replace(distill_coef=0.5)
    assert spec.needs_teacher and not L.ALGORITHMS["grpo"].needs_teacher
    res = L.compute_advantages(spec, REWARDS, OPD_MASK, group_size=G, logp_old=lo, logp_teacher=lt)
    on = OPD_MASK > 0
    lo0, lt0 = np.where(on, lo, 0.0), np.where(on, lt, 0.0)
    want = np.where(on, np_group_adv(REWARDS, G, "grpo")[:, None] - 0.5 * (lo0 - lt0), 0.0)
    close(res.advantages, want)
    m = res.metrics
    check_distill_metrics(m, want, lo, lt)
    # compute_loss runs the same advantage through grpo's own loss parts
    loss, lm = L.compute_loss(
        spec, lp, lo, OPD_MASK, rewards=REWARDS, group_size=G, logp_ref=lref, logp_teacher=lt
    )
    lp0, lref0 = np.where(on, lp, 0.0), np.where(on, lref, 0.0)
    pg = np_seq_mean_token_mean(np_ppo(lp0, lo0, want, OPD_MASK, 0.2, 0.2), OPD_MASK)
    kl = np_seq_mean_token_mean(np_kl(lp0, lref0, "k3") * OPD_MASK, OPD_MASK)
    close(loss, pg + 0.04 * kl)
    close(lm["reverse_kl"], m["reverse_kl"])
    # coefficient 0 is plain GRPO, with no reverse_kl
    plain = L.compute_advantages(L.ALGORITHMS["grpo"], REWARDS, OPD_MASK, group_size=G)
    assert "reverse_kl" not in plain.metrics
    close(plain.advantages, np_group_adv(REWARDS, G, "grpo")[:, None] * OPD_MASK)


def test_a_teacher_objective_without_teacher_log_probs_is_refused():
    _, lo, lb, _ = _opd_inputs()
    for spec in (L.ALGORITHMS["opd"], L.ALGORITHMS["grpo"].replace(distill_coef=0.5)):
        with pytest.raises(ValueError, match="needs logp_old and logp_teacher"):
            L.compute_advantages(spec, REWARDS, OPD_MASK, group_size=G, logp_old=lo)
        with pytest.raises(ValueError, match="needs logp_old and logp_teacher"):
            L.compute_loss(spec, lo, lo, OPD_MASK, rewards=REWARDS, logp_behaviour=lb)
    with pytest.raises(ValueError, match="advantage 'opd' needs logp_old and logp_teacher"):
        L.ADVANTAGES["opd"](REWARDS, OPD_MASK, logp_old=lo)


def test_distill_coef_with_the_opd_advantage_is_refused():
    with pytest.raises(ConfigError, match=r"loss.distill_coef.*0 with advantage='opd'"):
        L.LossSpec(advantage="opd", distill_coef=0.5)
    with pytest.raises(ConfigError, match=r"loss.distill_coef.*0 with advantage='opd'"):
        L.loss_spec("opd", distill_coef=0.5)
    with pytest.raises(ConfigError, match="loss.distill_coef"):
        L.LossSpec(distill_coef=-0.1)
    assert L.ALGORITHMS["opd"].needs_teacher
    assert not any(L.ALGORITHMS[a].needs_teacher for a in L.ALGORITHMS if a != "opd")


# --------------------------------------------------------------------------------------
# DAPO rollout-side helpers
# --------------------------------------------------------------------------------------


def test_filter_constant_groups():
    r3 = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(L.filter_constant_groups(r3, 3), [False, True, False])
    r = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.5, 0.5])
    np.testing.assert_array_equal(L.filter_constant_groups(r, 4), [False, True, False])
    np.testing.assert_array_equal(L.filter_constant_groups(r, 1), np.zeros(12, bool))
    with pytest.raises(ValueError, match="G=5"):
        L.filter_constant_groups(r, 5)


def test_overlong_penalty():
    lengths = np.array([0, 16, 17, 18, 20, 21])
    out = L.overlong_penalty(lengths, max_len=20, cache_len=4)
    np.testing.assert_allclose(out, [0, 0, -0.25, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_len"):
        L.overlong_penalty(lengths, max_len=4, cache_len=8)


@pytest.mark.parametrize("alg", ["grpo", "dapo", "drgrpo"])
def test_micro_batches_with_global_norm_sum_to_full_batch(alg):
    spec = L.ALGORITHMS[alg]
    lp, lo, kw = _inputs(alg, seed=7)
    adv = L.compute_advantages(spec, REWARDS, MASK, group_size=G).advantages
    full, _ = L.compute_loss(spec, lp, lo, MASK, advantages=adv, logp_ref=kw["logp_ref"])
    norm = MASK.sum() if spec.aggregation == "token_mean" else (MASK.sum(1) > 0).sum()
    parts = [
        L.compute_loss(
            spec, lp[s], lo[s], MASK[s], advantages=adv[s], logp_ref=kw["logp_ref"][s], norm=norm
        )[0]
        for s in (slice(0, 2), slice(2, 6))
    ]
    close(sum(parts), full)


def test_bfloat16_log_probs_are_upcast():
    lp, lo = _logps(14)
    A = _adv_tokens()
    per_tok, _ = L.ppo_clip_loss(
        jnp.asarray(lp, jnp.bfloat16), jnp.asarray(lo, jnp.bfloat16), A, MASK
    )
    assert per_tok.dtype == jnp.float32
    ref = np_ppo(
        np.asarray(jnp.asarray(lp, jnp.bfloat16), np.float32),
        np.asarray(jnp.asarray(lo, jnp.bfloat16), np.float32),
        A,
        MASK,
        0.2,
        0.2,
    )
    close(per_tok, ref)
