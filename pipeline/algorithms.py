"""The RL algorithms' settings, declared once (pure Python, no jax).

- The named parts an objective is composed of (`ADVANTAGES`, `POLICY_LOSSES`,
  `AGGREGATIONS`, `KL_ESTIMATORS`, `VALUE_LOSSES`, `IS_CORRECTIONS`), each with what it
  needs from the trainer (a critic's values, the aggregation's denominator).
- `LossSpec`: every loss hyper-parameter once, with its default and its one check.
- `PRESETS`: the algorithms (a LossSpec each) and `ROLLOUT_PRESETS`, their rollout side.

`pipeline.config` validates the run config's overrides against this module;
`tpu_jobs.learning.losses` registers the JAX implementation of every part under these names
(`implementations`), so neither re-lists a name.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pipeline.errors import ConfigError, check, one_of_text

# --------------------------------------------------------------------------------------
# Named parts and what they need
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """A named part of the objective (its implementation lives in `tpu_jobs.learning.losses`)."""

    summary: str


@dataclass(frozen=True)
class AdvantageEstimator(Part):
    # The estimator reads the rollout's critic values V(s_t): the trainer adds a value head.
    needs_values: bool = False
    # The estimator reads a teacher's log-probs of the sampled tokens (on-policy
    # distillation): the rollout batch carries them (`pipeline.distill`).
    needs_teacher: bool = False


# What an aggregation divides by: all real tokens, or the non-empty sequences. A trainer
# that splits a batch into micro-batches passes the whole batch's count instead.
DENOMINATORS = ("tokens", "sequences")


@dataclass(frozen=True)
class Aggregation(Part):
    denominator: str = "sequences"  # one of DENOMINATORS

    def __post_init__(self) -> None:
        if self.denominator not in DENOMINATORS:
            raise ValueError(f"denominator {self.denominator!r}; allowed: {DENOMINATORS}")


ADVANTAGES: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator("(r - mean_G) / (std_G + eps) over the G samples of a prompt"),
    "drgrpo": AdvantageEstimator("r - mean_G (Dr. GRPO: no std division)"),
    "rloo": AdvantageEstimator("r_i - mean of the other G - 1 rewards (leave-one-out)"),
    "reinforce": AdvantageEstimator("r, or r - batch mean with global_baseline"),
    "reinforce_pp": AdvantageEstimator("REINFORCE++: KL-penalised returns, batch-normalised"),
    "reinforce_pp_baseline": AdvantageEstimator("(r - mean_G) / batch std of that"),
    "gae": AdvantageEstimator("GAE(gamma, lambda) over a critic", needs_values=True),
    "opd": AdvantageEstimator(
        "-(log pi_old - log pi_teacher) per sampled token (on-policy distillation: the "
        "reverse KL to a teacher)",
        needs_teacher=True,
    ),
}
POLICY_LOSSES: dict[str, Part] = {
    "ppo_clip": Part("PPO/GRPO clipped surrogate (decoupled eps_low / eps_high)"),
    "gspo": Part("GSPO: the clipped surrogate on the sequence-level ratio"),
    "cispo": Part("CISPO: clipped IS weight times -A log pi"),
    "reinforce": Part("-A log pi, no ratio (on-policy)"),
}
AGGREGATIONS: dict[str, Aggregation] = {
    "seq_mean_token_mean": Aggregation("1/G sum_i 1/|o_i| sum_t (GRPO)", "sequences"),
    "token_mean": Aggregation("sum_{i,t} / sum_i |o_i| (DAPO token level)", "tokens"),
    "seq_mean_token_sum_norm": Aggregation("1/G sum_i 1/L_max sum_t (Dr. GRPO)", "sequences"),
    "seq_mean_token_sum": Aggregation("1/G sum_i sum_t (RLOO sequence log-likelihood)"),
}
KL_ESTIMATORS: dict[str, Part] = {
    "k1": Part("log pi - log pi_ref"),
    "k2": Part("(log pi_ref - log pi)^2 / 2"),
    "k3": Part("(r - 1) - log r, r = pi_ref / pi (GRPO)"),
}
VALUE_LOSSES: dict[str, Part] = {
    "clipped_value": Part("PPO2 clipped value loss"),
}
IS_CORRECTIONS: dict[str, Part] = {
    "none": Part("no weight"),
    "tis": Part("truncated IS: min(pi_old / pi_behaviour, C)"),
    "mis": Part("masked IS: the weight, 0 above C"),
}
IS_LEVELS = ("token", "sequence")

V = TypeVar("V")


def implementations(parts: Mapping[str, Part], impls: Mapping[str, V]) -> dict[str, V]:
    """`impls` (name -> implementation) checked against the declared `parts`: a name the
    specification does not declare raises at import, so an implementation cannot be
    picked by a name that no config accepts."""
    unknown = sorted(set(impls) - set(parts))
    if unknown:
        raise KeyError(
            f"implementations {unknown} have no declared part; declare them in "
            f"pipeline/algorithms.py first (declared: {', '.join(parts)})"
        )
    return dict(impls)


# --------------------------------------------------------------------------------------
# Hyper-parameters: one field and one check each
# --------------------------------------------------------------------------------------


def _param(default: Any, allowed: str, ok: Callable[[Any], bool]) -> Any:
    return field(default=default, metadata={"allowed": allowed, "ok": ok})


def _choice(default: str, names: Mapping[str, Any] | tuple[str, ...]) -> Any:
    names = tuple(names)
    return _param(default, one_of_text(names), lambda v: v in names)


def _flag(default: bool) -> Any:
    return _param(default, "true or false", lambda v: isinstance(v, bool))


@dataclass(frozen=True)
class LossSpec:
    """Which parts make up the objective and their hyper-parameters (hashable: pass it to
    `jax.jit` as a static argument). Paper symbols in brackets.

    advantage: key of ADVANTAGES.
    policy_loss: key of POLICY_LOSSES.
    aggregation: key of AGGREGATIONS.
    eps_low: lower clip range [epsilon of PPO/GRPO; eps_low of DAPO; eps_low^IS of CISPO].
    eps_high: upper clip range [epsilon; DAPO eps_high (clip-higher); CISPO eps_high^IS].
    dual_clip: dual-clip bound c > 1 for negative advantages [c, Ye et al. 2020]; 0 = off.
    kl_coef: weight of the KL(pi || pi_ref) loss term [beta of GRPO]; 0 = off.
    kl_estimator: key of KL_ESTIMATORS for that term (GRPO: k3).
    reward_kl_coef: per-token KL penalty folded into the token rewards [beta of REINFORCE++;
        the KL-in-reward of RLHF PPO]; used by "reinforce_pp" and "gae".
    entropy_coef: weight of the entropy bonus (needs `entropy` [B, T]); 0 = off.
    adv_eps: added to the std when normalising advantages.
    global_baseline: "reinforce" subtracts the batch mean reward.
    gamma: discount [gamma of PPO/GAE; REINFORCE++ returns].
    lam: GAE lambda [lambda of PPO].
    whiten_advantages: GAE advantages are normalised over the batch's real tokens.
    max_len: Dr. GRPO's constant length normaliser; 0 = the array width T (the completion
        slots, a tool episode's observation slots included: still a constant).
    value_loss: key of VALUE_LOSSES.
    vf_coef: weight of the value loss [c1 of PPO]; 0 = off.
    value_clip: clip range of the value loss.
    is_correction: key of IS_CORRECTIONS for sampler/trainer mismatch ("none", "tis", "mis").
    is_cap: the cap C of the IS weight.
    is_level: "token" or "sequence" importance ratio.
    distill_coef: on-policy distillation mixed into an RL objective: this weight times the
        "opd" advantage -(log pi_old - log pi_teacher) is added to every sampled token's
        advantage; 0 = off. (The "opd" advantage alone is the `opd` preset.)
    """

    advantage: str = _choice("grpo", ADVANTAGES)
    policy_loss: str = _choice("ppo_clip", POLICY_LOSSES)
    aggregation: str = _choice("seq_mean_token_mean", AGGREGATIONS)
    eps_low: float = _param(0.2, "[0, 1] (1 removes the lower bound)", lambda v: 0 <= v <= 1)
    eps_high: float = _param(0.2, ">= 0", lambda v: v >= 0)
    dual_clip: float = _param(0.0, "0 (off) or > 1", lambda v: v == 0 or v > 1)
    kl_coef: float = _param(0.0, ">= 0", lambda v: v >= 0)
    kl_estimator: str = _choice("k3", KL_ESTIMATORS)
    reward_kl_coef: float = _param(0.0, ">= 0", lambda v: v >= 0)
    entropy_coef: float = _param(0.0, ">= 0", lambda v: v >= 0)
    adv_eps: float = _param(1e-6, "> 0", lambda v: v > 0)
    global_baseline: bool = _flag(False)
    gamma: float = _param(1.0, "[0, 1]", lambda v: 0 <= v <= 1)
    lam: float = _param(0.95, "[0, 1]", lambda v: 0 <= v <= 1)
    whiten_advantages: bool = _flag(True)
    max_len: int = _param(0, ">= 0 (0: the array width)", lambda v: v >= 0)
    value_loss: str = _choice("clipped_value", VALUE_LOSSES)
    vf_coef: float = _param(0.0, ">= 0", lambda v: v >= 0)
    value_clip: float = _param(0.2, "> 0", lambda v: v > 0)
    is_correction: str = _choice("none", IS_CORRECTIONS)
    is_cap: float = _param(2.0, ">= 1", lambda v: v >= 1)
    is_level: str = _choice("token", IS_LEVELS)
    distill_coef: float = _param(0.0, ">= 0", lambda v: v >= 0)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_param(f.name, getattr(self, f.name), prefix="loss.")
        check(
            not (self.distill_coef > 0 and ADVANTAGES[self.advantage].needs_teacher),
            "loss.distill_coef",
            self.distill_coef,
            f"0 with advantage={self.advantage!r}, which is the distillation advantage "
            "alone (distill_coef mixes it into an RL advantage)",
        )

    def replace(self, **changes: Any) -> LossSpec:
        return dataclasses.replace(self, **changes)

    # What the objective needs from the trainer: asked here, so no caller compares names.
    @property
    def needs_value_head(self) -> bool:
        """A critic: the advantage reads its values, or the loss trains it."""
        return ADVANTAGES[self.advantage].needs_values or self.vf_coef > 0

    @property
    def needs_reference(self) -> bool:
        """Log-probs of the frozen reference policy (a KL loss term or a KL reward)."""
        return self.kl_coef > 0 or self.reward_kl_coef > 0

    @property
    def needs_teacher(self) -> bool:
        """A teacher's log-probs of the sampled tokens (on-policy distillation, alone or
        mixed into an RL advantage)."""
        return ADVANTAGES[self.advantage].needs_teacher or self.distill_coef > 0

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef > 0

    @property
    def denominator(self) -> str:
        """What the aggregation divides by (one of DENOMINATORS)."""
        return AGGREGATIONS[self.aggregation].denominator


_FIELDS = {f.name: f for f in dataclasses.fields(LossSpec)}
# The type of each hyper-parameter, for callers that coerce text (YAML, the command line).
PARAM_TYPES: dict[str, Any] = typing.get_type_hints(LossSpec)

# Shorthands accepted among the overrides: `clip_eps` sets eps_low and eps_high (the single
# epsilon of PPO/GRPO); an explicit eps_low / eps_high among the same overrides wins.
SHORTHANDS: dict[str, tuple[str, ...]] = {"clip_eps": ("eps_low", "eps_high")}
_SHORTHAND_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "clip_eps": ("(0, 1)", lambda v: 0 < v < 1),
}
PARAM_TYPES["clip_eps"] = float
OVERRIDE_KEYS = frozenset(PARAM_TYPES)  # what `check_overrides` / `expand` accept


def check_param(name: str, value: Any, prefix: str = "") -> None:
    """Raise ConfigError unless `value` is allowed for hyper-parameter (or shorthand)
    `name`; the message names `prefix + name` and what is allowed."""
    if name in _SHORTHAND_CHECKS:
        allowed, ok = _SHORTHAND_CHECKS[name]
    elif name in _FIELDS:
        allowed, ok = _FIELDS[name].metadata["allowed"], _FIELDS[name].metadata["ok"]
    else:
        raise ConfigError(
            f"unknown loss hyper-parameter '{prefix}{name}'; allowed: "
            + ", ".join(sorted(OVERRIDE_KEYS))
        )
    check(ok(value), prefix + name, value, allowed)


def expand(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`overrides` with each shorthand replaced by the fields it sets (explicit fields win)."""
    out = {k: v for k, v in overrides.items() if k not in SHORTHANDS}
    for short, names in SHORTHANDS.items():
        if short in overrides:
            for name in names:
                out.setdefault(name, overrides[short])
    return out


# --------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------

PRESETS: dict[str, LossSpec] = {
    # GRPO (Shao et al. 2024): eps = 0.2, beta = 0.04 with the k3 estimator.
    "grpo": LossSpec(kl_coef=0.04, kl_estimator="k3"),
    # Dr. GRPO (Liu et al. 2025): no std, constant-length normaliser, beta = 0.
    "drgrpo": LossSpec(advantage="drgrpo", aggregation="seq_mean_token_sum_norm"),
    # DAPO (Yu et al. 2025): clip-higher eps_low = 0.2 / eps_high = 0.28, token-level loss,
    # no KL. (Dynamic sampling and overlong shaping live on the rollout side, see below.)
    "dapo": LossSpec(eps_low=0.2, eps_high=0.28, aggregation="token_mean"),
    # RLOO (Ahmadian et al. 2024): leave-one-out REINFORCE on the sequence log-likelihood,
    # normalised by a constant length (same direction as the paper's sum, lr-friendly).
    "rloo": LossSpec(
        advantage="rloo", policy_loss="reinforce", aggregation="seq_mean_token_sum_norm"
    ),
    "reinforce": LossSpec(
        advantage="reinforce", policy_loss="reinforce", aggregation="seq_mean_token_sum_norm"
    ),
    # REINFORCE++ (Hu 2025): KL in the token reward (beta = 0.01 typical), global batch
    # normalisation, PPO clipped loss, token-level mean.
    "reinforce_pp": LossSpec(
        advantage="reinforce_pp", aggregation="token_mean", reward_kl_coef=0.01
    ),
    # REINFORCE++-baseline: group mean baseline, batch std; KL as a k2 loss term.
    "reinforce_pp_baseline": LossSpec(
        advantage="reinforce_pp_baseline",
        aggregation="token_mean",
        kl_coef=1e-3,
        kl_estimator="k2",
    ),
    # PPO (Schulman et al. 2017) with GAE: gamma = 1, lambda = 0.95 as usual for language
    # (the paper's control tasks used gamma = 0.99), eps = 0.2, c1 = 0.5.
    "ppo": LossSpec(
        advantage="gae",
        aggregation="token_mean",
        gamma=1.0,
        lam=0.95,
        vf_coef=0.5,
        value_clip=0.2,
    ),
    # GSPO (Zheng et al. 2025): sequence-level ratio, clip 3e-4 / 4e-4.
    "gspo": LossSpec(policy_loss="gspo", eps_low=3e-4, eps_high=4e-4),
    # CISPO (MiniMax-M1 2025): clipped IS weight, no lower bound, token-level mean.
    "cispo": LossSpec(policy_loss="cispo", eps_low=1.0, eps_high=0.28, aggregation="token_mean"),
    # On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025): the
    # per-token advantage -(log pi_old - log pi_teacher) on the student's own samples,
    # rewards unused, token-level mean (each token is its own decision), and truncated IS
    # against the sampler's log-probs over the staleness, as for RL. The clip keeps the
    # usual PPO trust region when a batch takes several updates.
    "opd": LossSpec(advantage="opd", aggregation="token_mean", is_correction="tis"),
}

# Rollout-side parts of a preset: DAPO's dynamic sampling and soft overlong punishment (Yu
# et al. 2025, sections 3.2 and 3.4). The overlong buffer L_cache is a fraction of
# L_max = sampler.max_new_tokens (the paper: 4096 / 20480).
ROLLOUT_PRESETS: dict[str, dict[str, Any]] = {
    "dapo": {"dynamic_sampling": True, "overlong_buffer_frac": 0.2},
}


def loss_spec(algorithm: str, **overrides: Any) -> LossSpec:
    """The preset of `algorithm` with `overrides` (LossSpec fields) applied (validated)."""
    if algorithm not in PRESETS:
        raise ConfigError(f"algorithm={algorithm!r} is invalid; allowed: {one_of_text(PRESETS)}")
    unknown = set(overrides) - set(_FIELDS)
    if unknown:
        raise ConfigError(
            f"unknown LossSpec field(s) {sorted(unknown)}; allowed: " + ", ".join(_FIELDS)
        )
    return dataclasses.replace(PRESETS[algorithm], **overrides)
