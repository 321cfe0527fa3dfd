"""Evaluation metrics over n sampled answers per problem (pure NumPy).

- `pass_at_k(n, c, k)`: the unbiased pass@k estimator of Chen et al. (2021),
  1 - C(n-c, k) / C(n, k), in the numerically stable product form
  1 - prod_{i=n-c+1}^{n} (1 - k / i); `pass_at_k_array` is the vectorised variant.
- `maj_at_k`: majority vote over the first k extracted answers; `weighted_vote` the same
  with a weight per sample (e.g. a verifier's probability: PRM-weighted voting).
- `avg_at_k`: mean correctness of the first k samples.
- `best_of_k`: correctness of the highest-scored of the first k samples (e.g. by a verifier
  or the model's own log-likelihood).
- `self_confidence`: a sample's score from its own tokens' log-probs under the policy that
  sampled it (mean, sum or lowest: `CONFIDENCE`), the free reranker beside Self-PRM.
- `bootstrap_ci`: percentile bootstrap confidence interval over problems.
- `summarise`: all of the above for several k, each as (mean, lo, hi).
- Judging (Self-PRM / ORM scores of samples against the verifier): `roc_auc`,
  `within_problem_auc`, `bootstrap_auc`,
  `judge_stats` (accuracy, precision, recall at a threshold, with counts),
  `difficulty_buckets` (hard / medium / easy terciles of per-problem pass rate) and
  `judge_stats_by_bucket`.
- Tool episodes: `tool_use_stats` (mean turns, tool-call rate, success rate of calls,
  failed calls by kind) of a batch's or an evaluation's episodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.tool_calls import ERROR_KINDS

ArrayLike = np.ndarray | Sequence[float] | Sequence[bool]


def _check_nck(n: int, c: int, k: int) -> None:
    if not 0 <= c <= n:
        raise ValueError(f"c={c} is invalid for n={n}; allowed: 0 <= c <= n")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} is invalid for n={n} samples; allowed: 1 <= k <= n")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Product form 1 - prod_{i=n-c+1}^{n} (1 - k/i): no large binomials, no overflow.
    """
    n, c, k = int(n), int(c), int(k)
    _check_nck(n, c, k)
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_array(n: ArrayLike | int, c: ArrayLike, k: int) -> np.ndarray:
    """`pass_at_k` for many problems at once: n (scalar or per problem) and c per problem."""
    c = np.asarray(c, dtype=np.int64)
    n = np.broadcast_to(np.asarray(n, dtype=np.int64), c.shape)
    if c.ndim != 1:
        raise ValueError(f"c must be 1-D (one count per problem), got shape {c.shape}")
    bad = (c < 0) | (c > n) | (k < 1) | (k > n)
    if np.any(bad):
        i = int(np.argmax(bad))
        _check_nck(int(n[i]), int(c[i]), k)
    prod = np.ones(c.shape, np.float64)
    # prod_{j=0}^{c-1} (1 - k / (n - c + 1 + j)); masked to j < c per problem.
    for j in range(int(c.max(initial=0))):
        active = j < c
        i = np.where(active, n - c + 1 + j, 1).astype(np.float64)
        prod *= np.where(active, 1.0 - k / i, 1.0)
    return np.where(n - c < k, 1.0, 1.0 - prod)


def per_problem_pass(columns: dict[str, Sequence], k: int) -> dict[str, float] | None:
    """{problem_id: unbiased pass@k} from an evaluation's per-sample columns (`problem_id`,
    `reward`; a sample is correct at reward >= 1, as the evaluator counts it), in the order
    problems first appear; None when a problem has fewer than k samples."""
    order = list(dict.fromkeys(columns["problem_id"]))
    index = {pid: i for i, pid in enumerate(order)}
    rows = np.asarray([index[pid] for pid in columns["problem_id"]])
    correct = np.asarray(columns["reward"], np.float64) >= 1.0
    n = np.bincount(rows, minlength=len(order))
    c = np.bincount(rows, weights=correct, minlength=len(order)).astype(np.int64)
    if n.min(initial=k) < k:
        return None
    return dict(zip(order, pass_at_k_array(n, c, k).tolist(), strict=True))


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> bool:
    """Majority vote over the first k extracted answers.

    None (unparseable) answers never win; if all of the first k are None the vote is
    incorrect. Ties in count are broken deterministically by the earliest first occurrence
    among the tied answers. The result is the correctness of the winning answer's first
    occurrence (samples with equal answers are graded equally).
    """
    return weighted_vote(answers, np.ones(len(answers)), correct, k)


def weighted_vote(
    answers: Sequence[str | None], weights: ArrayLike, correct: Sequence[bool], k: int
) -> bool:
    """`maj_at_k` where each of the first k samples adds its weight (not 1) to its answer:
    the answer with the largest total wins, ties to the earliest first occurrence. NaN
    weights count 0."""
    w = np.asarray(weights, dtype=np.float64)
    if not len(answers) == len(correct) == len(w):
        raise ValueError(
            f"answers ({len(answers)}), weights ({len(w)}) and correct ({len(correct)}) "
            "must have the same length"
        )
    if not 1 <= k <= len(answers):
        raise ValueError(f"k={k} is invalid for {len(answers)} samples; allowed: 1..{len(answers)}")
    totals: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers[:k]):
        if a is None:
            continue
        totals[a] = totals.get(a, 0.0) + (0.0 if np.isnan(w[i]) else float(w[i]))
        first.setdefault(a, i)
    if not totals:
        return False
    winner = min(totals, key=lambda a: (-totals[a], first[a]))
    return bool(correct[first[winner]])


def avg_at_k(correct: ArrayLike, k: int) -> float | np.ndarray:
    """Mean correctness of the first k samples (last axis); a float for one problem, an
    array [P] for a [P, n] input."""
    arr = np.asarray(correct, dtype=np.float64)
    if arr.ndim == 0 or not 1 <= k <= arr.shape[-1]:
        raise ValueError(f"k={k} is invalid for samples of shape {arr.shape}; allowed: 1..n")
    out = arr[..., :k].mean(axis=-1)
    return float(out) if out.ndim == 0 else out


def best_of_k(scores: ArrayLike, correct: Sequence[bool] | np.ndarray, k: int) -> bool:
    """Correctness of the highest-scored sample among the first k; ties go to the earliest,
    NaN scores rank lowest."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or len(s) != len(correct):
        raise ValueError(
            f"scores (shape {s.shape}) and correct ({len(correct)}) must be 1-D of equal length"
        )
    if not 1 <= k <= len(s):
        raise ValueError(f"k={k} is invalid for {len(s)} samples; allowed: 1..{len(s)}")
    s = np.where(np.isnan(s[:k]), -np.inf, s[:k])
    return bool(correct[int(np.argmax(s))])  # argmax returns the first maximum


# How a sample's own token log-probs become one self-confidence score (`eval.self_conf`):
# the mean is the length-normalised log-likelihood; the sum the sequence's; the lowest
# token its weakest step (a slip sampled at temperature 1 is a token the policy itself
# found unlikely).
CONFIDENCE = {"mean": np.mean, "sum": np.sum, "min": np.min}


def self_confidence(
    logprobs: Sequence[Sequence[float]],
    how: str,
    masks: Sequence[Sequence[int]] | None = None,
) -> np.ndarray:
    """[N] float64: each sample's log-probs of its own tokens, aggregated by
    `CONFIDENCE[how]`. `masks` (tool episodes): 1 on the tokens the policy wrote, 0 on the
    environment's, which are left out. A sample with no token of its own scores -inf (it
    ranks last in `best_of_k`)."""
    if how not in CONFIDENCE:
        raise ValueError(f"self-confidence {how!r} is unknown; allowed: {sorted(CONFIDENCE)}")
    if masks is not None and len(masks) != len(logprobs):
        raise ValueError(f"{len(masks)} masks for {len(logprobs)} samples; they must match")
    out = np.full(len(logprobs), -np.inf)
    for i, lp in enumerate(logprobs):
        own = np.asarray(lp, np.float64)
        if masks is not None:
            mask = np.asarray(masks[i], bool)
            if mask.shape != own.shape:
                raise ValueError(
                    f"sample {i}: {mask.size} mask entries for {own.size} log-probs; "
                    "they must match"
                )
            own = own[mask]
        if own.size:
            out[i] = CONFIDENCE[how](own)
    return out


def bootstrap_ci(
    per_problem_values: np.ndarray,
    *,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean over problems and its (1 - alpha) percentile bootstrap
    interval, resampling problems with replacement `n_boot` times (deterministic in seed)."""
    v = np.asarray(per_problem_values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        raise ValueError("bootstrap_ci needs at least one problem")
    if not np.all(np.isfinite(v)):
        raise ValueError("per_problem_values must be finite")
    if n_boot < 1 or not 0 < alpha < 1:
        raise ValueError(
            f"n_boot={n_boot}, alpha={alpha} are invalid; allowed: n_boot >= 1, 0 < alpha < 1"
        )
    rng = np.random.default_rng(seed)
    p = v.size
    means = np.empty(n_boot, np.float64)
    chunk = max(1, 4_000_000 // p)  # bound the index matrix to ~32 MB
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, p, size=(stop - start, p))
        means[start:stop] = v[idx].mean(axis=1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(v.mean()), float(lo), float(hi)


def summarise(
    correct: Sequence[Sequence[bool]] | np.ndarray,
    ks: Sequence[int],
    *,
    answers: Sequence[Sequence[str | None]] | None = None,
    scores: Sequence[Sequence[float]] | np.ndarray | None = None,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> dict[str, tuple[float, float, float]]:
    """Per-problem sample correctness (ragged lists allowed) -> {metric: (mean, lo, hi)}.

    Keys for each k: "pass@k" (unbiased estimator over all n samples of the problem),
    "avg@k"; "maj@k" if `answers` are given; "best_of@k" if `scores` are given. Every
    problem needs at least max(ks) samples.
    """
    if len(correct) == 0:
        raise ValueError("summarise needs at least one problem")
    rows = [np.asarray(c, dtype=bool).reshape(-1) for c in correct]
    n = np.array([len(r) for r in rows])
    c = np.array([int(r.sum()) for r in rows])
    for name, other in (("answers", answers), ("scores", scores)):
        if other is not None and (
            len(other) != len(rows)
            or any(len(o) != len(r) for o, r in zip(other, rows, strict=True))
        ):
            raise ValueError(f"{name} must have one entry per sample of correct")
    out: dict[str, tuple[float, float, float]] = {}

    def add(key: str, values: np.ndarray) -> None:
        out[key] = bootstrap_ci(values, n_boot=n_boot, alpha=alpha, seed=seed)

    for k in ks:
        if k < 1 or np.any(n < k):
            i = int(np.argmax(n < k)) if k >= 1 else 0
            raise ValueError(
                f"k={k} is invalid: problem {i} has {n[i]} samples; allowed: 1 <= k <= n"
            )
        add(f"pass@{k}", pass_at_k_array(n, c, k))
        add(f"avg@{k}", np.array([r[:k].mean() for r in rows]))
        if answers is not None:
            add(
                f"maj@{k}",
                np.array([maj_at_k(a, r, k) for a, r in zip(answers, rows, strict=True)], float),
            )
        if scores is not None:
            add(
                f"best_of@{k}",
                np.array([best_of_k(s, r, k) for s, r in zip(scores, rows, strict=True)], float),
            )
    return out


# ----------------------------------------------------------------------------- judging

DIFFICULTY_BUCKETS = ("hard", "medium", "easy")


def roc_auc(scores: ArrayLike, labels: ArrayLike) -> float | None:
    """Area under the ROC curve of `scores` for binary `labels` (Mann-Whitney U: the
    probability that a random positive outscores a random negative, ties counting 1/2).
    None when one class is absent (the AUC is undefined)."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=bool).reshape(-1)
    if s.shape != y.shape:
        raise ValueError(f"scores {s.shape} and labels {y.shape} must have the same length")
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    # 1-based average ranks (tied scores share the mean of their ranks), then
    # U = R_pos - n_pos (n_pos + 1) / 2.
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = (ends - (counts - 1) / 2.0)[inverse]
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def bootstrap_auc(
    scores: np.ndarray,
    correct: np.ndarray,
    *,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float, float] | None:
    """(auc, lo, hi) of scores [P, n] against correct [P, n]: the AUC over all samples and a
    percentile interval from resampling *problems* (samples of one problem stay together).
    None when the AUC is undefined; resamples with one class only are left out."""
    s = np.asarray(scores, dtype=np.float64)
    c = np.asarray(correct, dtype=bool)
    auc = roc_auc(s, c)
    if auc is None:
        return None
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_boot):
        idx = rng.integers(0, s.shape[0], size=s.shape[0])
        a = roc_auc(s[idx], c[idx])
        if a is not None:
            draws.append(a)
    if not draws:
        return auc, auc, auc
    lo, hi = np.quantile(draws, [alpha / 2, 1 - alpha / 2])
    return auc, float(lo), float(hi)


def within_problem_auc(scores: ArrayLike, correct: ArrayLike) -> np.ndarray:
    """Per problem with both correct and wrong samples, the `roc_auc` of its own samples'
    scores: how well a judge ranks the solutions of one problem, which is what reranking
    needs (the pooled AUC also rewards telling easy problems from hard ones). scores,
    correct: [P, n]; returns one value per mixed problem, in problem order."""
    s = np.asarray(scores, dtype=np.float64)
    c = np.asarray(correct, dtype=bool)
    if s.shape != c.shape or s.ndim != 2:
        raise ValueError(f"scores {s.shape} and correct {c.shape} must be the same [P, n] shape")
    out = [roc_auc(si, ci) for si, ci in zip(s, c, strict=True)]
    return np.array([a for a in out if a is not None], dtype=np.float64)


def _ratio(num: int, den: int) -> float | None:
    return None if den == 0 else num / den


def judge_stats(scores: ArrayLike, correct: ArrayLike, threshold: float = 0.5) -> dict:
    """How well scores judge samples against the verifier; the verdict is score > threshold.

    accuracy = P(verdict == correct); precision = P(correct | judged yes); recall =
    P(judged yes | correct); auc = `roc_auc`. Undefined ratios are None. Counts: samples,
    correct, judged_yes, true_pos (correct and judged yes)."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    c = np.asarray(correct, dtype=bool).reshape(-1)
    if s.shape != c.shape:
        raise ValueError(f"scores {s.shape} and correct {c.shape} must have the same size")
    yes = s > threshold
    tp = int((yes & c).sum())
    return {
        "accuracy": _ratio(int((yes == c).sum()), int(c.size)),
        "precision": _ratio(tp, int(yes.sum())),
        "recall": _ratio(tp, int(c.sum())),
        "auc": roc_auc(s, c),
        "samples": int(c.size),
        "correct": int(c.sum()),
        "judged_yes": int(yes.sum()),
        "true_pos": tp,
    }


def difficulty_buckets(correct: np.ndarray) -> np.ndarray:
    """[P] bucket index per problem (0 hard, 1 medium, 2 easy; `DIFFICULTY_BUCKETS`) from
    correct [P, n]: problems sorted by pass rate (ties by problem order, stable) and split
    by rank into three near-equal terciles (sizes differ by at most one, larger first)."""
    c = np.asarray(correct, dtype=bool)
    if c.ndim != 2:
        raise ValueError(f"correct must be [problems, samples], got shape {c.shape}")
    order = np.argsort(c.mean(axis=1), kind="stable")
    out = np.empty(c.shape[0], np.int64)
    for b, chunk in enumerate(np.array_split(order, len(DIFFICULTY_BUCKETS))):
        out[chunk] = b
    return out


def judge_stats_by_bucket(
    scores: np.ndarray, correct: np.ndarray, threshold: float = 0.5
) -> dict[str, dict]:
    """`judge_stats` per difficulty tercile (`difficulty_buckets`, from the same samples'
    pass rates), each with its problem count and pass-rate range."""
    s = np.asarray(scores, dtype=np.float64)
    c = np.asarray(correct, dtype=bool)
    if s.shape != c.shape or c.ndim != 2:
        raise ValueError(f"scores {s.shape} and correct {c.shape} must both be [problems, n]")
    buckets = difficulty_buckets(c)
    rates = c.mean(axis=1)
    out = {}
    for b, name in enumerate(DIFFICULTY_BUCKETS):
        ix = buckets == b
        stats = judge_stats(s[ix], c[ix], threshold)
        stats["problems"] = int(ix.sum())
        stats["pass_rate_min"] = float(rates[ix].min()) if ix.any() else None
        stats["pass_rate_max"] = float(rates[ix].max()) if ix.any() else None
        out[name] = stats
    return out


def tool_use_stats(
    turns: Sequence[int | None],
    tool_calls: Sequence[int | None],
    tool_errors: Sequence[Sequence[str] | None],
) -> dict[str, object]:
    """How a set of tool episodes used the tool (rows whose `turns` is None, single-turn
    ones, are left out; {} when none is an episode):

    episodes, mean_turns, tool_call_rate (fraction of episodes that called the tool at
    least once), calls_per_episode, tool_success_rate (fraction of calls that ran without
    an error; None without calls) and tool_errors ({ERROR_KINDS entry: failed calls})."""
    rows = [i for i, t in enumerate(turns) if t is not None]
    if not rows:
        return {}
    calls = np.asarray([tool_calls[i] or 0 for i in rows], np.int64)
    errors = [list(tool_errors[i] or ()) for i in rows]
    failed = sum(len(e) for e in errors)
    by_kind = {kind: 0 for kind in ERROR_KINDS}
    for e in errors:
        for kind in e:
            by_kind[kind] += 1
    return {
        "episodes": len(rows),
        "mean_turns": float(np.mean([turns[i] for i in rows])),
        "tool_call_rate": float((calls > 0).mean()),
        "calls_per_episode": float(calls.mean()),
        "tool_success_rate": float(1 - failed / calls.sum()) if calls.sum() else None,
        "tool_errors": by_kind,
    }
