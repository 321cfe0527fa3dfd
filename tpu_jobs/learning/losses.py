"""RL objectives for language models, composed from named parts.

The trainer builds one objective as

    advantage estimator -> policy loss -> aggregation (+ KL to a reference, - entropy,
    + value loss)

with each part chosen by name from a registry (dict): `ADVANTAGES`, `POLICY_LOSSES`,
`AGGREGATIONS`, `KL_ESTIMATORS`, `VALUE_LOSSES`, `IS_CORRECTIONS`. The names, what each
part needs, the `LossSpec` of hyper-parameters and the presets (`ALGORITHMS`) are declared
in `pipeline.algorithms` (no jax); this module holds the JAX implementations and registers
them against those names. `compute_loss(spec, ...)` runs the composition and returns
`(loss, metrics)`.

Array conventions (all completion-token arrays are [B, T], one row per sampled completion):

- `logp_new`: log-probs of the sampled tokens under the policy being trained (carries the
  gradient); `logp_old`: under the policy that is the anchor of the ratio (the behaviour /
  old policy, as recomputed by the trainer); `logp_ref`: under the frozen reference policy
  (KL regulariser); `logp_behaviour`: as reported by the sampler (for truncated importance
  sampling against a sampler/trainer mismatch).
- `mask`: 1 (or True) on real completion tokens, 0 elsewhere. Values at masked positions
  are never read (they are replaced by 0 before any arithmetic, so pads may hold -inf or
  NaN). Real tokens need not start at column 0 (the repository's rows are
  `[pad, prompt, completion, pad]`), and GAE / REINFORCE++ returns skip masked gaps.

The loss mask (tool episodes, learning to judge). The trainer passes as `mask` the
completion mask times `RolloutBatch.loss_mask`: 1 on the tokens the policy sampled, 0 on
context inside the completion (a tool's observations, a judged solution). Those tokens are
attended to by the model (the attention mask keeps them) but every part below sees only the
sampled tokens, exactly as if the masked ones were absent from the row:

- losses, KL and entropy terms and every metric (clip fractions, ratio, KL, entropy,
  advantage and IS statistics) are over sampled tokens; `num_tokens` counts them;
- token-level aggregation ("token_mean", DAPO) divides by the batch's sampled tokens;
  "seq_mean_token_mean" by each sequence's sampled tokens; Dr. GRPO's L_max stays the
  constant `max_len` (default: the array width, observation slots included);
- GSPO's sequence ratio is the geometric mean over the sampled tokens; a sequence-level IS
  weight is the product over them;
- the terminal reward sits on the last sampled token (an episode that ends on an
  observation ends, for the policy, on its last own token), and GAE, REINFORCE++ returns
  and the KL reward penalty treat an observation as part of the environment's transition,
  not as a step: V and A flow from the next sampled token across the gap with no
  discount (gamma and lambda count sampled tokens only), the critic's values at masked
  positions are neither read nor trained.
- `rewards`: one scalar per sequence, [B].
- Groups (GRPO-style): rows are `num_prompts * G` contiguous groups of size `G`
  (`group_size=G`), or any grouping given by integer `group_ids` [B] (O(B^2) pairwise
  comparison, cheap for the batch sizes of RL on language models).

Every part is a pure JAX function, jit-able (hyper-parameters and names are static Python
values; nothing branches on traced values), differentiable, and NaN-free when whole
sequences (or the whole batch) are masked. A fully masked sequence contributes nothing:
adding one leaves the loss and its gradient unchanged.

Per-token parts (policy losses, KL estimators, value losses) return a per-token array [B, T]
that an aggregation reduces to the scalar loss; advantage estimators return an
`AdvantageResult`; every part also returns a `dict[str, scalar]` of metrics.

The DAPO helpers for the rollout side (`filter_constant_groups`, `overlong_penalty`) are plain
NumPy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipeline import algorithms
from pipeline.algorithms import LossSpec, implementations, loss_spec

# The presets are declared in pipeline.algorithms (no jax); this name is the JAX side's view.
ALGORITHMS = algorithms.PRESETS

Array = jax.Array
Metrics = dict[str, Array]

# Log-ratios are clamped to this magnitude before exponentiation: a ratio outside
# [e^-20, e^20] means the two policies disagree completely, and an `inf` ratio would turn
# the zero gradient of an unselected `min`/`where` branch into NaN (0 * inf).
MAX_LOG_RATIO = 20.0


# --------------------------------------------------------------------------------------
# Masked reductions (all NaN-free on empty masks)
# --------------------------------------------------------------------------------------


def _fmask(mask: Array) -> Array:
    return jnp.asarray(mask).astype(jnp.float32)


def _clean(x: Array, mask: Array) -> Array:
    """`x` with masked positions set to 0 (so pads holding inf/NaN never leak)."""
    x = jnp.asarray(x)
    return jnp.where(jnp.asarray(mask) > 0, x, jnp.zeros_like(x))


def masked_sum(x: Array, mask: Array, axis: int | None = None) -> Array:
    return jnp.sum(_clean(x, mask) * _fmask(mask).astype(jnp.result_type(x, jnp.float32)), axis)


def masked_mean(x: Array, mask: Array, axis: int | None = None) -> Array:
    """Mean over `mask`ed entries; 0 where nothing is unmasked."""
    count = jnp.sum(_fmask(mask), axis)
    return masked_sum(x, mask, axis) / jnp.maximum(count, 1.0)


def masked_std(x: Array, mask: Array) -> Array:
    """Population (ddof=0) standard deviation over all unmasked entries."""
    mean = masked_mean(x, mask)
    return jnp.sqrt(masked_mean(jnp.square(x - mean), mask))


def masked_max(x: Array, mask: Array) -> Array:
    """Max over unmasked entries; 0 if there are none."""
    m = jnp.asarray(mask) > 0
    return jnp.where(jnp.any(m), jnp.max(jnp.where(m, x, -jnp.inf)), 0.0)


def masked_min(x: Array, mask: Array) -> Array:
    """Min over unmasked entries; 0 if there are none."""
    m = jnp.asarray(mask) > 0
    return jnp.where(jnp.any(m), jnp.min(jnp.where(m, x, jnp.inf)), 0.0)


def _safe_exp_log_ratio(log_ratio: Array) -> Array:
    return jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def _seq_log_ratio(logp_a: Array, logp_b: Array, mask: Array) -> Array:
    """Sum over real tokens of log(a/b) per sequence: the log of the sequence-level ratio."""
    return masked_sum(logp_a - logp_b, mask, axis=-1)


def _to_tokens(x: Array, mask: Array) -> Array:
    """Broadcast a per-sequence [B] array to [B, T] (zero on masked tokens); pass [B, T]."""
    x = jnp.asarray(x)
    if x.ndim == 1:
        x = x[:, None]
    return _clean(jnp.broadcast_to(x, jnp.shape(mask)).astype(jnp.float32), mask)


def _last_token(mask: Array) -> Array:
    """[B, T] float, 1 at the last real token of each row (all 0 for an empty row)."""
    m = jnp.asarray(mask) > 0
    t = m.shape[-1]
    last = t - 1 - jnp.argmax(m[:, ::-1], axis=-1)  # argmax of an all-False row is 0
    is_last = jnp.arange(t)[None, :] == last[:, None]
    return (is_last & m).astype(jnp.float32)


# --------------------------------------------------------------------------------------
# Group statistics
# --------------------------------------------------------------------------------------


class _GroupStats(NamedTuple):
    """Per-row statistics of the row's group (each [B])."""

    count: Array
    mean: Array
    std: Array  # population std, ddof=0
    constant: Array  # bool: every reward in the group is equal


def _group_stats(rewards: Array, group_size: int | None, group_ids: Array | None) -> _GroupStats:
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 1:
        raise ValueError(f"rewards must have shape [B], got {r.shape}")
    b = r.shape[0]
    if group_ids is not None:
        gid = jnp.asarray(group_ids)
        if gid.shape != (b,):
            raise ValueError(f"group_ids must have shape [B]=({b},), got {gid.shape}")
        same = gid[:, None] == gid[None, :]
        samef = same.astype(jnp.float32)
        count = samef.sum(-1)
        mean = (samef @ r) / count
        # Two-pass (around the mean) variance: no cancellation.
        var = jnp.sum(samef * jnp.square(r[None, :] - mean[:, None]), -1) / count
        gmax = jnp.max(jnp.where(same, r[None, :], -jnp.inf), -1)
        gmin = jnp.min(jnp.where(same, r[None, :], jnp.inf), -1)
        return _GroupStats(count, mean, jnp.sqrt(var), gmax == gmin)
    if group_size is None or group_size < 1 or b % group_size != 0:
        raise ValueError(
            f"group_size={group_size!r} is invalid for a batch of {b} rows; allowed: a "
            f"positive divisor of {b} (rows are num_prompts * G contiguous groups), or pass "
            "group_ids"
        )
    g = r.reshape(b // group_size, group_size)
    mean = g.mean(-1, keepdims=True)
    std = jnp.sqrt(jnp.mean(jnp.square(g - mean), -1, keepdims=True))
    constant = g.max(-1, keepdims=True) == g.min(-1, keepdims=True)

    def rows(x: Array) -> Array:
        return jnp.broadcast_to(x, g.shape).reshape(b)

    count = jnp.full((b,), float(group_size), jnp.float32)
    return _GroupStats(count, rows(mean), rows(std), rows(constant))


# --------------------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------------------


class AdvantageResult(NamedTuple):
    """Output of an advantage estimator.

    advantages: [B, T], zero on masked tokens (sequence-level estimates are broadcast).
    returns: [B, T] value targets (GAE only; None otherwise).
    metrics: scalars.
    """

    advantages: Array
    returns: Array | None
    metrics: Metrics


def _adv_metrics(adv: Array, mask: Array, rewards: Array, extra: Metrics | None = None) -> Metrics:
    out = {
        "adv_mean": masked_mean(adv, mask),
        "adv_std": masked_std(adv, mask),
        "adv_max": masked_max(adv, mask),
        "adv_min": masked_min(adv, mask),
        "reward_mean": jnp.mean(jnp.asarray(rewards, jnp.float32)),
        "reward_std": jnp.std(jnp.asarray(rewards, jnp.float32)),
    }
    out.update(extra or {})
    return out


def grpo_advantages(
    rewards: Array,
    mask: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    eps: float = 1e-6,
    **_: Any,
) -> AdvantageResult:
    """GRPO outcome supervision (Shao et al. 2024, eq. for Â_{i,t}): (r - mean_G) / (std_G + eps).

    The group std is the population std (ddof=0, NumPy's default), which is what the
    DeepSeekMath formula's std over the G outputs of one question means and what most
    implementations that use `unbiased=False` compute; ddof=1 would scale every advantage
    by sqrt((G-1)/G). A group whose rewards are all equal gets advantage exactly 0 (tested
    by max == min, not by the floating-point std), so it contributes no gradient.
    """
    st = _group_stats(rewards, group_size, group_ids)
    r = jnp.asarray(rewards, jnp.float32)
    adv = jnp.where(st.constant, 0.0, (r - st.mean) / (st.std + eps))
    tok = _to_tokens(adv, mask)
    return AdvantageResult(
        tok, None, _adv_metrics(tok, mask, r, {"frac_constant_groups": _frac_rows(st.constant)})
    )


def _frac_rows(flag: Array) -> Array:
    return jnp.mean(flag.astype(jnp.float32))


def drgrpo_advantages(
    rewards: Array,
    mask: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    **_: Any,
) -> AdvantageResult:
    """Dr. GRPO (Liu et al. 2025): r - mean_G, without the std division (removes the
    question-level difficulty bias)."""
    st = _group_stats(rewards, group_size, group_ids)
    r = jnp.asarray(rewards, jnp.float32)
    adv = jnp.where(st.constant, 0.0, r - st.mean)
    tok = _to_tokens(adv, mask)
    return AdvantageResult(
        tok, None, _adv_metrics(tok, mask, r, {"frac_constant_groups": _frac_rows(st.constant)})
    )


def rloo_advantages(
    rewards: Array,
    mask: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    **_: Any,
) -> AdvantageResult:
    """RLOO (Ahmadian et al. 2024): r_i - (1/(k-1)) sum_{j != i} r_j over the k samples of the
    prompt. Equal to k/(k-1) * (r_i - mean). A group of one sample has no baseline: 0."""
    st = _group_stats(rewards, group_size, group_ids)
    r = jnp.asarray(rewards, jnp.float32)
    n = st.count
    baseline = (st.mean * n - r) / jnp.maximum(n - 1.0, 1.0)
    adv = jnp.where((n > 1) & ~st.constant, r - baseline, 0.0)
    tok = _to_tokens(adv, mask)
    return AdvantageResult(
        tok, None, _adv_metrics(tok, mask, r, {"frac_constant_groups": _frac_rows(st.constant)})
    )


def reinforce_advantages(
    rewards: Array,
    mask: Array,
    *,
    global_baseline: bool = False,
    **_: Any,
) -> AdvantageResult:
    """REINFORCE (Williams 1992): the raw reward, minus the batch mean reward if
    `global_baseline` (a constant baseline keeps the gradient unbiased)."""
    r = jnp.asarray(rewards, jnp.float32)
    adv = r - jnp.mean(r) if global_baseline else r
    tok = _to_tokens(adv, mask)
    return AdvantageResult(tok, None, _adv_metrics(tok, mask, r))


def _token_rewards(
    rewards: Array,
    mask: Array,
    logp_old: Array | None,
    logp_ref: Array | None,
    kl_coef: float,
) -> tuple[Array, Array]:
    """Per-token rewards: terminal reward at the last real token, -kl_coef * KL_t (k1
    estimate log pi_old - log pi_ref, no gradient) on every real token. Returns (r_t, kl_t)."""
    r = jnp.asarray(rewards, jnp.float32)
    tok = _last_token(mask) * r[:, None]
    if kl_coef and logp_ref is not None:
        if logp_old is None:
            raise ValueError("a per-token KL reward penalty needs logp_old (and logp_ref)")
        kl = _clean(jax.lax.stop_gradient(logp_old - logp_ref), mask).astype(jnp.float32)
    else:
        kl = jnp.zeros(jnp.shape(mask), jnp.float32)
    return tok - kl_coef * kl, kl


def discounted_returns(token_rewards: Array, mask: Array, gamma: float = 1.0) -> Array:
    """G_t = sum_{s >= t, s real} gamma^(#real tokens between) r_s, over real tokens only
    (masked gaps are skipped); 0 on masked tokens."""
    m = jnp.asarray(mask) > 0
    r = _clean(token_rewards, mask).astype(jnp.float32)

    def step(carry: Array, xs: tuple[Array, Array]) -> tuple[Array, Array]:
        r_t, m_t = xs
        ret = r_t + gamma * carry
        return jnp.where(m_t, ret, carry), jnp.where(m_t, ret, 0.0)

    _, out = jax.lax.scan(step, jnp.zeros(r.shape[0], r.dtype), (r.T, m.T), reverse=True)
    return out.T


def reinforce_pp_advantages(
    rewards: Array,
    mask: Array,
    *,
    logp_old: Array | None = None,
    logp_ref: Array | None = None,
    reward_kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-6,
    **_: Any,
) -> AdvantageResult:
    """REINFORCE++ (Hu 2025): token rewards r_t = 1[t = last] r - beta * KL_t (beta =
    `reward_kl_coef`, KL_t = log pi_old - log pi_ref), returns G_t = sum_s gamma^(s-t) r_s,
    then global batch normalisation (G - mean) / (std + eps) over all real tokens of the
    batch (no per-prompt grouping)."""
    tok_r, kl = _token_rewards(rewards, mask, logp_old, logp_ref, reward_kl_coef)
    ret = discounted_returns(tok_r, mask, gamma)
    adv = _clean((ret - masked_mean(ret, mask)) / (masked_std(ret, mask) + eps), mask)
    return AdvantageResult(
        adv, None, _adv_metrics(adv, mask, rewards, {"reward_kl": masked_mean(kl, mask)})
    )


def reinforce_pp_baseline_advantages(
    rewards: Array,
    mask: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    eps: float = 1e-6,
    **_: Any,
) -> AdvantageResult:
    """REINFORCE++-baseline (Hu 2025): A' = r - mean_G (group mean baseline), then divided by
    the std of A' over all real tokens of the batch (token-weighted, ddof=0, as OpenRLHF).

    The batch mean is not subtracted again: after group centring it is ~0 already, and
    subtracting it would move constant groups off exactly 0.
    """
    st = _group_stats(rewards, group_size, group_ids)
    r = jnp.asarray(rewards, jnp.float32)
    centred = _to_tokens(jnp.where(st.constant, 0.0, r - st.mean), mask)
    adv = centred / (masked_std(centred, mask) + eps)
    return AdvantageResult(
        adv, None, _adv_metrics(adv, mask, r, {"frac_constant_groups": _frac_rows(st.constant)})
    )


def gae_advantages(
    rewards: Array,
    mask: Array,
    *,
    values: Array | None = None,
    logp_old: Array | None = None,
    logp_ref: Array | None = None,
    reward_kl_coef: float = 0.0,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    eps: float = 1e-6,
    **_: Any,
) -> AdvantageResult:
    """GAE (Schulman et al. 2016) for PPO (Schulman et al. 2017).

    values: [B, T] critic values V(s_t) of the rollout (no gradient). Token rewards as in
    `_token_rewards` (terminal reward at the last real token, optional per-token KL penalty).
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, where t+1 is the
    next real token and the state after the last real token is terminal (V = 0; a completion
    cut at max_new_tokens is treated as terminal too). returns = A + V (before whitening).
    Masked tokens (a tool's observation) are not steps: t+1 is the next unmasked token even
    across a gap, so the observation is part of the transition from t to t+1 and its
    values are never read.
    If `whiten`, advantages are normalised over all real tokens of the batch.
    """
    if values is None:
        raise ValueError("advantage 'gae' needs values [B, T] from the critic (old_values)")
    m = jnp.asarray(mask) > 0
    v = _clean(jax.lax.stop_gradient(values), mask).astype(jnp.float32)
    tok_r, kl = _token_rewards(rewards, mask, logp_old, logp_ref, reward_kl_coef)

    def step(carry: tuple[Array, Array], xs: tuple[Array, Array, Array]):
        next_v, next_adv = carry
        r_t, v_t, m_t = xs
        adv = r_t + gamma * next_v - v_t + gamma * lam * next_adv
        carry = (jnp.where(m_t, v_t, next_v), jnp.where(m_t, adv, next_adv))
        return carry, jnp.where(m_t, adv, 0.0)

    zeros = jnp.zeros(v.shape[0], jnp.float32)
    _, adv = jax.lax.scan(step, (zeros, zeros), (tok_r.T, v.T, m.T), reverse=True)
    adv = adv.T
    returns = _clean(adv + v, mask)
    if whiten:
        adv = _clean((adv - masked_mean(adv, mask)) / (masked_std(adv, mask) + eps), mask)
    extra = {"reward_kl": masked_mean(kl, mask), "returns_mean": masked_mean(returns, mask)}
    return AdvantageResult(adv, returns, _adv_metrics(adv, mask, rewards, extra))


def distill_advantages(logp_student: Array, logp_teacher: Array, mask: Array) -> Array:
    """[B, T] on-policy distillation advantage -(log pi_student - log pi_teacher) of each
    sampled token, 0 on masked tokens: minus the one-sample estimate of the reverse KL's
    per-token term, so a policy gradient on it lowers KL(pi_student || pi_teacher) over
    the states the student visits (Agarwal et al. 2024; Thinking Machines 2025, with a
    discount of 0: each token's advantage is its own term, not a return)."""
    diff = _clean(logp_student, mask) - _clean(logp_teacher, mask)
    return jnp.where(_fmask(mask) > 0, -diff, 0.0)


def opd_advantages(
    rewards: Array,
    mask: Array,
    *,
    logp_old: Array | None = None,
    logp_teacher: Array | None = None,
    **_: Any,
) -> AdvantageResult:
    """The `opd` preset's advantage: `distill_advantages` of pi_old (rewards are reported,
    not used)."""
    if logp_old is None or logp_teacher is None:
        raise ValueError(
            "advantage 'opd' needs logp_old and logp_teacher (the teacher's log-probs)"
        )
    adv = distill_advantages(logp_old, logp_teacher, mask)
    return AdvantageResult(adv, None, _adv_metrics(adv, mask, rewards))


ADVANTAGES: dict[str, Callable[..., AdvantageResult]] = implementations(
    algorithms.ADVANTAGES,
    {
        "grpo": grpo_advantages,
        "drgrpo": drgrpo_advantages,
        "rloo": rloo_advantages,
        "reinforce": reinforce_advantages,
        "reinforce_pp": reinforce_pp_advantages,
        "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
        "gae": gae_advantages,
        "opd": opd_advantages,
    },
)


# --------------------------------------------------------------------------------------
# Importance-sampling corrections (sampler/trainer mismatch)
# --------------------------------------------------------------------------------------


def _is_log_ratio(
    logp_old_trainer: Array, logp_behaviour: Array, mask: Array | None, level: str
) -> tuple[Array, Array]:
    if mask is None:
        mask = jnp.ones(jnp.shape(logp_old_trainer), jnp.float32)
    if level == "token":
        lr = _clean(logp_old_trainer - logp_behaviour, mask)
    elif level == "sequence":
        lr = jnp.broadcast_to(
            _seq_log_ratio(logp_old_trainer, logp_behaviour, mask)[:, None], jnp.shape(mask)
        )
    else:
        raise ValueError(f"level={level!r} is invalid; allowed: 'token', 'sequence'")
    return jax.lax.stop_gradient(lr.astype(jnp.float32)), mask


def tis_weight(
    logp_old_trainer: Array,
    logp_behaviour: Array,
    cap: float,
    mask: Array | None = None,
    level: str = "token",
) -> Array:
    """Truncated importance sampling weight min(pi_trainer / pi_sampler, C) (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"; C = `cap`).

    Corrects for the sampler's log-probs differing from the trainer's for the same weights.
    level='token': per-token ratio; 'sequence': product over the sequence's real tokens,
    broadcast to its tokens. No gradient flows through the weight. [B, T] float32.
    """
    lr, _ = _is_log_ratio(logp_old_trainer, logp_behaviour, mask, level)
    return jnp.minimum(_safe_exp_log_ratio(lr), cap)


def masked_is_weight(
    logp_old_trainer: Array,
    logp_behaviour: Array,
    cap: float,
    mask: Array | None = None,
    level: str = "token",
) -> Array:
    """Masked importance sampling (MIS): rho * 1[rho <= C] — tokens (or whole sequences)
    whose ratio exceeds the cap are dropped instead of truncated (Liu et al. 2025, "When
    speed kills stability"). No gradient flows through the weight. [B, T] float32."""
    lr, _ = _is_log_ratio(logp_old_trainer, logp_behaviour, mask, level)
    rho = _safe_exp_log_ratio(lr)
    return jnp.where(rho <= cap, rho, 0.0)


IS_CORRECTIONS: dict[str, Callable[..., Array] | None] = implementations(
    algorithms.IS_CORRECTIONS,
    {
        "none": None,
        "tis": tis_weight,
        "mis": masked_is_weight,
    },
)


def is_metrics(
    logp_old_trainer: Array, logp_behaviour: Array, weight: Array, mask: Array, cap: float
) -> Metrics:
    """Mismatch diagnostics: mean weight, fraction of tokens over the cap, k3 KL(trainer ||
    sampler) estimate (samples come from the sampler) and max |log-ratio|."""
    lr = _clean(jax.lax.stop_gradient(logp_old_trainer - logp_behaviour), mask)
    rho = _safe_exp_log_ratio(lr)
    return {
        "is_weight_mean": masked_mean(weight, mask),
        "is_frac_over_cap": masked_mean((rho > cap).astype(jnp.float32), mask),
        "mismatch_kl": masked_mean(rho - 1.0 - lr, mask),
        "mismatch_abs_log_ratio_max": masked_max(jnp.abs(lr), mask),
    }


# --------------------------------------------------------------------------------------
# Policy losses: per-token losses [B, T] to be aggregated, plus metrics
# --------------------------------------------------------------------------------------


def _apply_is_weight(per_token: Array, is_weight: Array | None) -> Array:
    if is_weight is None:
        return per_token
    return per_token * jax.lax.stop_gradient(jnp.asarray(is_weight, per_token.dtype))


def _ratio_metrics(
    ratio: Array,
    log_ratio: Array,
    mask: Array,
    clipped_low: Array,
    clipped_high: Array,
) -> Metrics:
    ratio = jax.lax.stop_gradient(ratio)
    log_ratio = jax.lax.stop_gradient(log_ratio)
    low = masked_mean(clipped_low.astype(jnp.float32), mask)
    high = masked_mean(clipped_high.astype(jnp.float32), mask)
    return {
        "clip_frac_low": low,
        "clip_frac_high": high,
        "clip_frac": low + high,
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": masked_max(ratio, mask),
        "ratio_min": masked_min(ratio, mask),
        # k3 estimate of KL(pi_old || pi_new) on samples from pi_old.
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
    }


def _upcast(x: Array) -> Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _prepare(
    logp_new: Array, logp_old: Array, advantages: Array, mask: Array
) -> tuple[Array, Array, Array, Array]:
    # Ratios of bfloat16 log-probs are too coarse: compute in (at least) float32.
    logp_new = _upcast(_clean(logp_new, mask))
    logp_old = jax.lax.stop_gradient(_upcast(_clean(logp_old, mask)))
    adv = jax.lax.stop_gradient(_to_tokens(advantages, mask))
    return logp_new, logp_old, adv, _fmask(mask)


def _clipped_surrogate(
    ratio: Array, adv: Array, eps_low: float, eps_high: float, dual_clip: float
) -> tuple[Array, Array, Array, Array]:
    """PPO's pessimistic surrogate as a loss: max(-A r, -A clip(r)), optionally dual-clipped."""
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(-adv * ratio, -adv * clipped)
    # Where the clipped branch is active (and differs), the gradient is zero.
    clipped_low = (ratio < 1.0 - eps_low) & (adv < 0)
    clipped_high = (ratio > 1.0 + eps_high) & (adv > 0)
    dual = jnp.zeros_like(clipped_low)
    if dual_clip:
        # Dual clip (Ye et al. 2020): for A < 0 bound the loss by -c A, so a huge ratio on a
        # bad action cannot produce an unbounded update.
        dual = (adv < 0) & (ratio > dual_clip)
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
    return loss, clipped_low, clipped_high, dual


def ppo_clip_loss(
    logp_new: Array,
    logp_old: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float = 0.0,
    is_weight: Array | None = None,
) -> tuple[Array, Metrics]:
    """Clipped surrogate (PPO, Schulman et al. 2017; GRPO, Shao et al. 2024), per token:

        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),  r_t = pi / pi_old

    eps_low = eps_high = epsilon of PPO/GRPO; decoupled eps_low / eps_high are DAPO's
    "clip-higher" (Yu et al. 2025: eps_low = 0.2, eps_high = 0.28). `dual_clip` = c > 1
    (0 disables) additionally bounds the loss of negative-advantage tokens by -c A.
    `is_weight` (e.g. `tis_weight`) multiplies the per-token loss without gradient.
    Metrics: clip_frac_low (r < 1 - eps_low and A < 0), clip_frac_high (r > 1 + eps_high and
    A > 0) — exactly the tokens whose gradient is clipped to zero — ratio stats, approx_kl.
    """
    logp_new, logp_old, adv, m = _prepare(logp_new, logp_old, advantages, mask)
    log_ratio = logp_new - logp_old
    ratio = _safe_exp_log_ratio(log_ratio)
    loss, low, high, dual = _clipped_surrogate(ratio, adv, eps_low, eps_high, dual_clip)
    metrics = _ratio_metrics(ratio, log_ratio, m, low, high)
    metrics["dual_clip_frac"] = masked_mean(dual.astype(jnp.float32), m)
    return _clean(_apply_is_weight(loss, is_weight), m), metrics


def gspo_loss(
    logp_new: Array,
    logp_old: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    dual_clip: float = 0.0,
    is_weight: Array | None = None,
) -> tuple[Array, Metrics]:
    """GSPO (Zheng et al. 2025): the clipped surrogate on the sequence-level ratio

        s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t log(pi / pi_old)),

    (|y_i| and the mean over the sampled tokens of the mask: a tool's observations are not
    part of y_i)

    clipped to [1 - eps_low, 1 + eps_high] (the paper's 3e-4 / 4e-4). Written in the
    GSPO-token form s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]: its value is s_i on every token
    and, aggregated with "seq_mean_token_mean", its gradient is exactly GSPO's; it also accepts
    per-token advantages. Clip fractions are token-weighted (a clipped sequence counts all of
    its tokens).
    """
    logp_new, logp_old, adv, m = _prepare(logp_new, logp_old, advantages, mask)
    seq_lr = masked_mean(logp_new - logp_old, m, axis=-1)
    tok_lr = jax.lax.stop_gradient(seq_lr)[:, None] + logp_new - jax.lax.stop_gradient(logp_new)
    ratio = _safe_exp_log_ratio(tok_lr)
    loss, low, high, dual = _clipped_surrogate(ratio, adv, eps_low, eps_high, dual_clip)
    seq_ratio = _safe_exp_log_ratio(jax.lax.stop_gradient(seq_lr))
    nonempty = (m.sum(-1) > 0).astype(jnp.float32)
    metrics = _ratio_metrics(ratio, jnp.broadcast_to(seq_lr[:, None], m.shape), m, low, high)
    metrics.update(
        {
            "ratio_max": masked_max(seq_ratio, nonempty),
            "ratio_min": masked_min(seq_ratio, nonempty),
            "dual_clip_frac": masked_mean(dual.astype(jnp.float32), m),
        }
    )
    return _clean(_apply_is_weight(loss, is_weight), m), metrics


def cispo_loss(
    logp_new: Array,
    logp_old: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    dual_clip: float = 0.0,
    is_weight: Array | None = None,
) -> tuple[Array, Metrics]:
    """CISPO (MiniMax-M1, 2025): l_t = -sg(clip(r_t, 1 - eps_low^IS, 1 + eps_high^IS)) A_t
    log pi(y_t). The IS weight is clipped instead of the update, so every token keeps a
    gradient. The paper sets no lower bound ("eps_low^IS large", here 1.0 -> bound 0) and
    tunes only eps_high^IS (no value given; 0.28 is a common default). `dual_clip` is
    accepted for a uniform signature and ignored. Clip fractions count truncated weights
    regardless of the advantage's sign (the gradient is not zeroed there).
    """
    del dual_clip
    logp_new, logp_old, adv, m = _prepare(logp_new, logp_old, advantages, mask)
    log_ratio = jax.lax.stop_gradient(logp_new - logp_old)
    ratio = _safe_exp_log_ratio(log_ratio)
    weight = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -weight * adv * logp_new
    low = ratio < 1.0 - eps_low
    high = ratio > 1.0 + eps_high
    metrics = _ratio_metrics(ratio, log_ratio, m, low, high)
    return _clean(_apply_is_weight(loss, is_weight), m), metrics


def reinforce_loss(
    logp_new: Array,
    logp_old: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float = 0.0,
    is_weight: Array | None = None,
) -> tuple[Array, Metrics]:
    """Vanilla policy gradient l_t = -w_t A_t log pi(y_t), w = `is_weight` (e.g. a TIS weight,
    no gradient) or 1. On-policy only: no ratio to pi_old enters the loss (logp_old is used
    for the ratio metrics alone). eps_low / eps_high / dual_clip are accepted for a uniform
    signature and ignored."""
    del eps_low, eps_high, dual_clip
    logp_new, logp_old, adv, m = _prepare(logp_new, logp_old, advantages, mask)
    log_ratio = jax.lax.stop_gradient(logp_new - logp_old)
    ratio = _safe_exp_log_ratio(log_ratio)
    loss = _apply_is_weight(-adv * logp_new, is_weight)
    none = jnp.zeros(m.shape, bool)
    return _clean(loss, m), _ratio_metrics(ratio, log_ratio, m, none, none)


POLICY_LOSSES: dict[str, Callable[..., tuple[Array, Metrics]]] = implementations(
    algorithms.POLICY_LOSSES,
    {
        "ppo_clip": ppo_clip_loss,
        "gspo": gspo_loss,
        "cispo": cispo_loss,
        "reinforce": reinforce_loss,
    },
)


# --------------------------------------------------------------------------------------
# Value losses
# --------------------------------------------------------------------------------------


def clipped_value_loss(
    values: Array,
    old_values: Array,
    returns: Array,
    mask: Array,
    *,
    clip: float = 0.2,
) -> tuple[Array, Metrics]:
    """PPO value loss 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) per token
    (c = `clip`, as in the OpenAI baselines PPO2 implementation)."""
    v = _clean(values, mask)
    v_old = jax.lax.stop_gradient(_clean(old_values, mask))
    ret = jax.lax.stop_gradient(_clean(returns, mask))
    v_clipped = v_old + jnp.clip(v - v_old, -clip, clip)
    unclipped = jnp.square(v - ret)
    clipped = jnp.square(v_clipped - ret)
    loss = 0.5 * jnp.maximum(unclipped, clipped)
    resid_var = masked_mean(jnp.square(ret - v), mask)
    ret_var = jnp.square(masked_std(ret, mask))
    metrics = {
        "vf_clip_frac": masked_mean((clipped > unclipped).astype(jnp.float32), mask),
        "value_mean": masked_mean(jax.lax.stop_gradient(v), mask),
        "explained_variance": jax.lax.stop_gradient(1.0 - resid_var / jnp.maximum(ret_var, 1e-8)),
    }
    return _clean(loss, mask), metrics


VALUE_LOSSES: dict[str, Callable[..., tuple[Array, Metrics]]] = implementations(
    algorithms.VALUE_LOSSES,
    {
        "clipped_value": clipped_value_loss,
    },
)


# --------------------------------------------------------------------------------------
# Aggregations: per-token [B, T] -> scalar
# --------------------------------------------------------------------------------------
#
# `norm` overrides the denominator (number of sequences for the seq_* modes, number of
# tokens for token_mean) so that a batch split into micro-batches can use the full batch's
# count and sum the micro-batch losses. By default only non-empty sequences are counted, so a
# fully masked row contributes nothing.


def _num_sequences(mask: Array) -> Array:
    return jnp.maximum(jnp.sum((_fmask(mask).sum(-1) > 0).astype(jnp.float32)), 1.0)


def _num_tokens(mask: Array) -> Array:
    return jnp.maximum(jnp.sum(_fmask(mask)), 1.0)


# The counts an aggregation divides by, by the denominator its declaration names.
DENOMINATORS: dict[str, Callable[[Array], Array]] = {
    "tokens": _num_tokens,
    "sequences": _num_sequences,
}


def aggregation_norm(spec: LossSpec, mask: Array) -> Array:
    """The denominator of `spec`'s aggregation over `mask` [B, T]: pass it as `norm` to
    every micro-batch of a batch so that their losses sum to the whole batch's."""
    return DENOMINATORS[spec.denominator](mask)


def seq_mean_token_mean(
    per_token: Array, mask: Array, *, max_len: int | None = None, norm: Any = None
) -> Array:
    """Original GRPO: (1/G) sum_i (1/|o_i|) sum_t l_{i,t} — each sequence weighs the same."""
    del max_len
    per_seq = masked_mean(per_token, mask, axis=-1)
    return jnp.sum(per_seq) / (_num_sequences(mask) if norm is None else norm)


def token_mean(
    per_token: Array, mask: Array, *, max_len: int | None = None, norm: Any = None
) -> Array:
    """DAPO token-level: sum_{i,t} l_{i,t} / sum_i |o_i| — each token weighs the same."""
    del max_len
    total = masked_sum(per_token, mask)
    return total / (_num_tokens(mask) if norm is None else norm)


def seq_mean_token_sum_norm(
    per_token: Array, mask: Array, *, max_len: int | None = None, norm: Any = None
) -> Array:
    """Dr. GRPO: (1/G) sum_i (1/L_max) sum_t l_{i,t} with a constant L_max (`max_len`,
    default T = the array's width), removing the length bias of 1/|o_i|."""
    length = float(max_len) if max_len else float(jnp.shape(per_token)[-1])
    per_seq = masked_sum(per_token, mask, axis=-1) / length
    return jnp.sum(per_seq) / (_num_sequences(mask) if norm is None else norm)


def seq_mean_token_sum(
    per_token: Array, mask: Array, *, max_len: int | None = None, norm: Any = None
) -> Array:
    """(1/G) sum_i sum_t l_{i,t}: the sequence log-likelihood REINFORCE of RLOO (Ahmadian et
    al. 2024). Gradient scale grows with length."""
    del max_len
    per_seq = masked_sum(per_token, mask, axis=-1)
    return jnp.sum(per_seq) / (_num_sequences(mask) if norm is None else norm)


AGGREGATIONS: dict[str, Callable[..., Array]] = implementations(
    algorithms.AGGREGATIONS,
    {
        "seq_mean_token_mean": seq_mean_token_mean,
        "token_mean": token_mean,
        "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
        "seq_mean_token_sum": seq_mean_token_sum,
    },
)


# --------------------------------------------------------------------------------------
# KL estimators of KL(pi || pi_ref), per token, on samples from pi
# --------------------------------------------------------------------------------------
# Schulman, "Approximating KL divergence" (2020), with r = pi_ref / pi:
#   k1 = -log r                 unbiased, high variance, can be negative
#   k2 = (log r)^2 / 2          biased, low variance, >= 0
#   k3 = (r - 1) - log r        unbiased, low variance, >= 0 (used by GRPO)


def kl_k1(logp: Array, logp_ref: Array) -> Array:
    return logp - logp_ref


def kl_k2(logp: Array, logp_ref: Array) -> Array:
    return 0.5 * jnp.square(logp_ref - logp)


def kl_k3(logp: Array, logp_ref: Array) -> Array:
    log_r = jnp.clip(logp_ref - logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    # expm1 keeps (r - 1) - log r accurate (and >= 0) when r is close to 1.
    return jnp.maximum(jnp.expm1(log_r) - log_r, 0.0)


KL_ESTIMATORS: dict[str, Callable[[Array, Array], Array]] = implementations(
    algorithms.KL_ESTIMATORS,
    {
        "k1": kl_k1,
        "k2": kl_k2,
        "k3": kl_k3,
    },
)


# --------------------------------------------------------------------------------------
# The composed objective
# --------------------------------------------------------------------------------------


def compute_advantages(
    spec: LossSpec,
    rewards: Array,
    mask: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    logp_old: Array | None = None,
    logp_ref: Array | None = None,
    values: Array | None = None,
    logp_teacher: Array | None = None,
) -> AdvantageResult:
    """Run `spec.advantage` with the spec's hyper-parameters. Call it once per rollout batch
    (whole groups) before splitting into micro-batches / PPO epochs. `values` are the
    rollout-time critic values (GAE only). `logp_teacher` [B, T]: a teacher's log-probs of
    the sampled tokens, needed when `spec.needs_teacher`; with `spec.distill_coef` > 0,
    that times the distillation advantage is added to every sampled token's advantage
    (the mixed mode). Either way the metrics gain `reverse_kl`, the mean of
    log pi_old - log pi_teacher over sampled tokens (the one-sample reverse-KL estimate)."""
    if spec.needs_teacher and (logp_teacher is None or logp_old is None):
        raise ValueError(
            f"advantage={spec.advantage!r}, distill_coef={spec.distill_coef} needs logp_old "
            "and logp_teacher (a teacher's log-probs of the sampled tokens, distill.teacher)"
        )
    logp_old = None if logp_old is None else jax.lax.stop_gradient(logp_old)
    logp_teacher = None if logp_teacher is None else jax.lax.stop_gradient(logp_teacher)
    res = ADVANTAGES[spec.advantage](
        rewards,
        mask,
        group_size=group_size,
        group_ids=group_ids,
        eps=spec.adv_eps,
        global_baseline=spec.global_baseline,
        logp_old=logp_old,
        logp_ref=None if logp_ref is None else jax.lax.stop_gradient(logp_ref),
        reward_kl_coef=spec.reward_kl_coef,
        gamma=spec.gamma,
        lam=spec.lam,
        whiten=spec.whiten_advantages,
        values=values,
        logp_teacher=logp_teacher,
    )
    if not spec.needs_teacher:
        return res
    distill = distill_advantages(logp_old, logp_teacher, mask)
    metrics = dict(res.metrics)
    metrics["reverse_kl"] = -masked_mean(distill, mask)  # the advantage is minus its terms
    advantages = res.advantages
    if spec.distill_coef > 0:
        advantages = _to_tokens(advantages, mask) + spec.distill_coef * distill
        # Every advantage statistic describes the mixed advantage the loss uses.
        metrics.update(_adv_metrics(advantages, mask, rewards))
    return AdvantageResult(advantages, res.returns, metrics)


def compute_loss(
    spec: LossSpec,
    logp_new: Array,
    logp_old: Array,
    mask: Array,
    *,
    rewards: Array | None = None,
    advantages: Array | None = None,
    group_size: int | None = None,
    group_ids: Array | None = None,
    logp_ref: Array | None = None,
    logp_behaviour: Array | None = None,
    values: Array | None = None,
    old_values: Array | None = None,
    returns: Array | None = None,
    entropy: Array | None = None,
    norm: Any = None,
    row_weight: Array | None = None,
    logp_teacher: Array | None = None,
) -> tuple[Array, Metrics]:
    """The full objective of `spec` (a scalar to minimise) and its metrics.

    Either `advantages` ([B] or [B, T], e.g. from `compute_advantages` over the whole batch)
    or `rewards` [B] (advantages computed here, with `group_size` / `group_ids`) must be
    given. Optional parts and what they need:
      kl_coef > 0 -> logp_ref; entropy_coef > 0 -> entropy [B, T] (exact per-token entropy of
      pi, with gradient); vf_coef > 0 -> values (with gradient), old_values, returns (or
      advantage "gae", which produces them from old_values); is_correction != "none" ->
      logp_behaviour (the sampler's log-probs; the weight is pi_old / pi_sampler).
    `norm` overrides the aggregation's denominator (see AGGREGATIONS) for micro-batching.
    `row_weight` [B] multiplies every per-token loss part of a row before aggregation (the
    denominators still count the row as one sequence / its tokens): learning to judge's
    `trainer.judge_loss_weight`. None: every row weighs 1 (the same program as before).
    `logp_teacher` [B, T]: a teacher's log-probs of the sampled tokens, when `rewards` are
    given and `spec.needs_teacher` (`compute_advantages`).

    Metrics (scalars): loss, pg_loss, the policy loss's clip/ratio metrics, kl_ref (k3 mean,
    if logp_ref given), kl_loss, entropy (if given), neg_logp_mean (entropy proxy: mean
    -log pi of the sampled tokens), num_tokens, and the advantage / IS / value metrics.
    """
    mask = jnp.asarray(mask)
    m = _fmask(mask)
    metrics: Metrics = {}
    if advantages is None:
        if rewards is None:
            raise ValueError("compute_loss needs advantages or rewards")
        res = compute_advantages(
            spec,
            rewards,
            mask,
            group_size=group_size,
            group_ids=group_ids,
            logp_old=logp_old,
            logp_ref=logp_ref,
            values=old_values,
            logp_teacher=logp_teacher,
        )
        advantages = res.advantages
        if returns is None:
            returns = res.returns
        metrics.update(res.metrics)
    advantages = jax.lax.stop_gradient(_to_tokens(advantages, mask))

    is_weight = None
    is_fn = IS_CORRECTIONS[spec.is_correction]
    if is_fn is not None:
        if logp_behaviour is None:
            raise ValueError(
                f"is_correction={spec.is_correction!r} needs logp_behaviour (the sampler's "
                "log-probs); pass it or set is_correction='none'"
            )
        is_weight = is_fn(logp_old, logp_behaviour, spec.is_cap, mask, spec.is_level)
        metrics.update(is_metrics(logp_old, logp_behaviour, is_weight, mask, spec.is_cap))

    aggregate = AGGREGATIONS[spec.aggregation]

    def agg(x: Array) -> Array:
        if row_weight is not None:
            x = x * jnp.asarray(row_weight, x.dtype)[:, None]
        return aggregate(x, mask, max_len=spec.max_len or None, norm=norm)

    per_token, pm = POLICY_LOSSES[spec.policy_loss](
        logp_new,
        logp_old,
        advantages,
        mask,
        eps_low=spec.eps_low,
        eps_high=spec.eps_high,
        dual_clip=spec.dual_clip,
        is_weight=is_weight,
    )
    metrics.update(pm)
    pg_loss = agg(per_token)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss

    if logp_ref is not None:
        metrics["kl_ref"] = masked_mean(
            kl_k3(jax.lax.stop_gradient(_clean(logp_new, mask)), _clean(logp_ref, mask)), m
        )
    if spec.kl_coef > 0:
        if logp_ref is None:
            raise ValueError(f"kl_coef={spec.kl_coef} > 0 needs logp_ref (or set kl_coef=0)")
        kl_tok = KL_ESTIMATORS[spec.kl_estimator](
            _clean(logp_new, mask), jax.lax.stop_gradient(_clean(logp_ref, mask))
        )
        kl_loss = agg(kl_tok)
        loss = loss + spec.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss

    if entropy is not None:
        metrics["entropy"] = masked_mean(jax.lax.stop_gradient(entropy), m)
    if spec.entropy_coef > 0:
        if entropy is None:
            raise ValueError(
                f"entropy_coef={spec.entropy_coef} > 0 needs entropy [B, T] (the sampled-token "
                "-log p is not a usable entropy gradient)"
            )
        ent = agg(_clean(entropy, mask))
        loss = loss - spec.entropy_coef * ent

    if spec.vf_coef > 0:
        if values is None or old_values is None or returns is None:
            raise ValueError(
                f"vf_coef={spec.vf_coef} > 0 needs values, old_values and returns (or the "
                "'gae' advantage with rewards and old_values)"
            )
        v_tok, vm = VALUE_LOSSES[spec.value_loss](
            values, old_values, returns, mask, clip=spec.value_clip
        )
        v_loss = agg(v_tok)
        loss = loss + spec.vf_coef * v_loss
        metrics.update(vm)
        metrics["vf_loss"] = v_loss

    metrics["neg_logp_mean"] = masked_mean(-jax.lax.stop_gradient(_clean(logp_new, mask)), m)
    metrics["num_tokens"] = jnp.sum(m)
    metrics["loss"] = loss
    return loss, metrics


# --------------------------------------------------------------------------------------
# DAPO rollout-side helpers (NumPy)
# --------------------------------------------------------------------------------------


def filter_constant_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """DAPO dynamic sampling (Yu et al. 2025): keep mask [num_groups] (bool), False for
    groups whose G rewards are all equal (all correct or all wrong: zero advantage, no
    gradient). Expand to rows with `np.repeat(keep, G)`."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or group_size < 1 or r.shape[0] % group_size:
        raise ValueError(
            f"rewards of shape {r.shape} cannot be split into groups of G={group_size}; "
            "allowed: a 1-D array whose length is a multiple of G >= 1"
        )
    g = r.reshape(-1, group_size)
    return g.max(axis=1) != g.min(axis=1)


def overlong_penalty(lengths: np.ndarray, max_len: int, cache_len: int) -> np.ndarray:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward:

        0                                  if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        -1                                 if |y| > L_max

    with L_max = `max_len`, L_cache = `cache_len` (the paper: 20480 and 4096).

    In a tool episode |y| counts every completion token, the tool's observations included,
    and L_max is the episode's token budget: the penalty is the soft ramp before the cut
    that the budget makes, and the budget counts observations too (counting only sampled
    tokens would let an episode be cut with no penalty, the reward noise this removes).
    The policy controls the observations' length through what its programs print.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(
            f"cache_len={cache_len!r} is invalid for max_len={max_len!r}; allowed: "
            "0 < cache_len <= max_len"
        )
    n = np.asarray(lengths, dtype=np.float64)
    safe = max_len - cache_len
    pen = np.where(n <= safe, 0.0, (safe - n) / cache_len)
    return np.where(n > max_len, -1.0, pen)


__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "ALGORITHMS",
    "IS_CORRECTIONS",
    "KL_ESTIMATORS",
    "MAX_LOG_RATIO",
    "POLICY_LOSSES",
    "VALUE_LOSSES",
    "DENOMINATORS",
    "AdvantageResult",
    "LossSpec",
    "aggregation_norm",
    "compute_advantages",
    "compute_loss",
    "discounted_returns",
    "filter_constant_groups",
    "is_metrics",
    "loss_spec",
    "masked_is_weight",
    "masked_mean",
    "overlong_penalty",
    "tis_weight",
]
