"""Evaluation metrics against closed forms and brute-force enumeration."""

import itertools
from math import comb

import numpy as np
import pytest

from pipeline.metrics import (
    DIFFICULTY_BUCKETS,
    avg_at_k,
    best_of_k,
    bootstrap_auc,
    bootstrap_ci,
    difficulty_buckets,
    judge_stats,
    judge_stats_by_bucket,
    maj_at_k,
    pass_at_k,
    pass_at_k_array,
    roc_auc,
    self_confidence,
    summarise,
    weighted_vote,
    within_problem_auc,
)


def test_pass_at_k_closed_form():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-12)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - comb(7, 5) / comb(10, 5), abs=1e-12)
    assert pass_at_k(10, 3, 5) == pytest.approx(11 / 12, abs=1e-12)
    assert pass_at_k(10, 3, 10) == 1.0
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(5, 1, 5) == 1.0  # n - c < k


@pytest.mark.parametrize("n", [1, 2, 4, 6])
def test_pass_at_k_brute_force(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = np.mean([any(samples[i] for i in s) for s in subsets])
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_stable():
    # C(1000, 500) overflows float64; the product form does not.
    v = pass_at_k(1000, 3, 500)
    assert v == pytest.approx(1 - (500 * 499 * 498) / (1000 * 999 * 998), rel=1e-12)


def test_pass_at_k_array_matches_scalar():
    n = np.array([10, 10, 8, 5, 16])
    c = np.array([3, 0, 8, 1, 7])
    for k in (1, 3, 5):
        expected = [pass_at_k(int(a), int(b), k) for a, b in zip(n, c, strict=True)]
        np.testing.assert_allclose(pass_at_k_array(n, c, k), expected, atol=1e-12)
    np.testing.assert_allclose(pass_at_k_array(10, [3, 0], 5), [11 / 12, 0.0], atol=1e-12)


def test_pass_at_k_validation():
    with pytest.raises(ValueError, match="k=11"):
        pass_at_k(10, 3, 11)
    with pytest.raises(ValueError, match="c=12"):
        pass_at_k(10, 12, 1)
    with pytest.raises(ValueError, match="k=0"):
        pass_at_k_array([4, 4], [1, 2], 0)


def test_maj_at_k_majority_and_ties():
    answers = ["7", "5", "5", "7", "9"]
    correct = [True, False, False, True, False]
    assert maj_at_k(answers, correct, 1) is True  # "7"
    assert maj_at_k(answers, correct, 3) is False  # "5" x2
    # k=4: "7" x2 vs "5" x2 tie -> "7" occurs first -> correct.
    assert maj_at_k(answers, correct, 4) is True
    # Same tie with the order swapped -> "5" first -> incorrect.
    assert maj_at_k(["5", "7", "7", "5"], [False, True, True, False], 4) is False


def test_maj_at_k_unparseable_answers():
    # None is the most frequent but never wins.
    assert maj_at_k([None, None, None, "3"], [False, False, False, True], 4) is True
    assert maj_at_k([None, None, "4", "3"], [False, False, False, True], 4) is False  # tie
    # All None -> incorrect even if a "correct" flag were set.
    assert maj_at_k([None, None], [True, True], 2) is False
    with pytest.raises(ValueError, match="same length"):
        maj_at_k(["1"], [True, False], 1)


def test_weighted_vote_sums_weights_per_answer():
    answers = ["7", "5", "5", "7", None, "9"]
    correct = [True, False, False, True, False, False]
    # "7": 0.9 + 0.2 = 1.1 beats "5": 0.3 + 0.4 = 0.7 and "9": 1.0, whatever the counts.
    w = [0.9, 0.3, 0.4, 0.2, 5.0, 1.0]
    assert weighted_vote(answers, w, correct, 6) is True
    assert weighted_vote(answers, w, correct, 3) is True  # "7" 0.9 against "5" 0.7
    assert weighted_vote(answers, [0.1, 0.3, 0.4, 0.2, 0, 1.0], correct, 6) is False  # "9"
    # Ties go to the earliest first occurrence; a NaN weight counts 0; None never wins.
    assert weighted_vote(["5", "7"], [0.5, 0.5], [False, True], 2) is False
    assert weighted_vote(["5", "7"], [np.nan, 0.1], [False, True], 2) is True
    assert weighted_vote([None, None], [1.0, 1.0], [True, True], 2) is False
    # Unit weights are the majority vote.
    rng = np.random.default_rng(0)
    for _ in range(200):
        ans = [str(a) if a < 4 else None for a in rng.integers(0, 5, 8)]
        corr = [a == "1" for a in ans]
        k = int(rng.integers(1, 9))
        assert weighted_vote(ans, np.ones(8), corr, k) == maj_at_k(ans, corr, k)
    with pytest.raises(ValueError, match=r"weights \(2\)"):
        weighted_vote(["1"], [1.0, 1.0], [True], 1)
    with pytest.raises(ValueError, match="k=2 is invalid"):
        weighted_vote(["1"], [1.0], [True], 2)


def test_avg_at_k():
    assert avg_at_k([1, 0, 1, 1], 2) == 0.5
    assert avg_at_k([1, 0, 1, 1], 4) == 0.75
    np.testing.assert_allclose(avg_at_k(np.array([[1, 0, 1], [0, 0, 1]]), 3), [2 / 3, 1 / 3])


def test_best_of_k():
    correct = [False, True, False, True]
    assert best_of_k([0.1, 0.9, 0.5, 0.9], correct, 4) is True
    assert best_of_k([0.1, 0.9, 0.5, 0.9], correct, 1) is False
    assert best_of_k([0.5, 0.5, 0.5, 0.5], [False, True, True, True], 4) is False  # earliest
    assert best_of_k([np.nan, 0.0], [False, True], 2) is True  # NaN ranks lowest


def test_best_of_k_perfect_scorer_is_any_correct_upper_bound():
    rng = np.random.default_rng(0)
    for _ in range(50):
        correct = rng.random(8) < 0.3
        scores = correct.astype(float) + 0.01 * rng.random(8)  # perfect verifier
        for k in (1, 3, 8):
            assert best_of_k(scores, correct, k) == bool(correct[:k].any())


def test_bootstrap_contains_mean_narrows_and_is_deterministic():
    rng = np.random.default_rng(1)
    small = (rng.random(50) < 0.4).astype(float)
    large = (rng.random(2000) < 0.4).astype(float)
    m_s, lo_s, hi_s = bootstrap_ci(small, n_boot=500, seed=3)
    m_l, lo_l, hi_l = bootstrap_ci(large, n_boot=500, seed=3)
    assert m_s == pytest.approx(small.mean())
    assert lo_s <= m_s <= hi_s
    assert lo_l <= m_l <= hi_l
    assert hi_l - lo_l < hi_s - lo_s
    # Normal-approximation width as a sanity check (binary data): ~2 * 1.96 * sd / sqrt(P).
    expected = 2 * 1.96 * large.std() / np.sqrt(large.size)
    assert (hi_l - lo_l) == pytest.approx(expected, rel=0.2)
    assert bootstrap_ci(small, n_boot=500, seed=3) == (m_s, lo_s, hi_s)
    assert bootstrap_ci(small, n_boot=500, seed=4) != (m_s, lo_s, hi_s)
    assert bootstrap_ci(np.array([0.7]), n_boot=10) == pytest.approx((0.7, 0.7, 0.7))
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_ci(np.array([]))


def test_summarise():
    correct = [[True, False, False, True], [False, False, False, False], [True, True, True, False]]
    answers = [["1", "2", "2", "1"], ["3", None, "4", "4"], ["5", "5", "5", "6"]]
    scores = [[0.1, 0.9, 0.2, 0.3], [0.0, 0.0, 0.0, 0.0], [0.2, 0.1, 0.0, 0.9]]
    out = summarise(correct, ks=(1, 4), answers=answers, scores=scores, n_boot=200)
    assert set(out) == {f"{m}@{k}" for m in ("pass", "avg", "maj", "best_of") for k in (1, 4)}
    assert out["pass@1"][0] == pytest.approx(np.mean([2 / 4, 0, 3 / 4]))
    assert out["pass@4"][0] == pytest.approx(np.mean([1, 0, 1]))
    assert out["avg@1"][0] == pytest.approx(np.mean([1, 0, 1]))
    assert out["maj@4"][0] == pytest.approx(np.mean([1, 0, 1]))  # tie "1"/"2" -> "1"
    assert out["best_of@4"][0] == pytest.approx(np.mean([0, 0, 0]))
    for mean, lo, hi in out.values():
        assert lo <= mean <= hi
    with pytest.raises(ValueError, match="k=5"):
        summarise(correct, ks=(5,))


def test_pass_at_k_array_brute_force_random():
    # Random (n, c) pairs against enumeration of every k-subset of one arrangement.
    rng = np.random.default_rng(7)
    n = np.array([rng.integers(1, 8) for _ in range(20)])
    c = np.array([rng.integers(0, ni + 1) for ni in n])
    for k in range(1, int(n.min()) + 1):
        brute = [
            np.mean([any(i < ci for i in s) for s in itertools.combinations(range(ni), k)])
            for ni, ci in zip(n, c, strict=True)
        ]
        np.testing.assert_allclose(pass_at_k_array(n, c, k), brute, atol=1e-12)


def test_maj_at_k_against_counter_reference():
    from collections import Counter

    rng = np.random.default_rng(3)
    vocab = ["1", "2", "3", None]
    for _ in range(200):
        answers = [vocab[i] for i in rng.integers(0, 4, 6)]
        correct = [a == "2" for a in answers]
        for k in range(1, 7):
            counts = Counter(a for a in answers[:k] if a is not None)
            if not counts:
                expected = False
            else:
                top = max(counts.values())
                winner = next(a for a in answers[:k] if a is not None and counts[a] == top)
                expected = winner == "2"
            assert maj_at_k(answers, correct, k) is expected, (answers, k)


def test_roc_auc_against_pairwise_brute_force():
    rng = np.random.default_rng(5)
    for _ in range(30):
        s = rng.integers(0, 5, 12).astype(float)  # many ties
        y = rng.random(12) < 0.5
        pos, neg = s[y], s[~y]
        if len(pos) == 0 or len(neg) == 0:
            assert roc_auc(s, y) is None
            continue
        brute = np.mean([(p > q) + 0.5 * (p == q) for p in pos for q in neg])
        assert roc_auc(s, y) == pytest.approx(brute, abs=1e-12)
    assert roc_auc([0.1, 0.9], [False, True]) == 1.0
    assert roc_auc([0.9, 0.1], [False, True]) == 0.0
    assert roc_auc([0.5, 0.5], [True, True]) is None


def test_bootstrap_auc_resamples_problems():
    scores = np.array([[0.9, 0.2], [0.8, 0.1], [0.3, 0.7], [0.6, 0.4]])
    correct = np.array([[True, False], [True, False], [False, True], [True, False]])
    auc, lo, hi = bootstrap_auc(scores, correct, n_boot=200, seed=0)
    assert auc == 1.0 and lo == hi == 1.0  # a perfect ranking stays perfect in every resample
    assert bootstrap_auc(scores, np.ones_like(correct), n_boot=10) is None


def test_judge_stats_hand_computed():
    scores = [0.9, 0.8, 0.4, 0.6, 0.2, 0.5]
    correct = [True, False, True, True, False, False]
    st = judge_stats(scores, correct)  # yes = [T, T, F, T, F, F] (0.5 is not > 0.5)
    assert (st["samples"], st["correct"], st["judged_yes"], st["true_pos"]) == (6, 3, 3, 2)
    assert st["precision"] == pytest.approx(2 / 3)
    assert st["recall"] == pytest.approx(2 / 3)
    assert st["accuracy"] == pytest.approx(4 / 6)  # right on 0.9, 0.6, 0.2, 0.5
    empty = judge_stats([0.1, 0.2], [False, False])
    assert empty["precision"] is None and empty["recall"] is None and empty["accuracy"] == 1.0


def test_difficulty_terciles_and_precision_recall_by_bucket():
    # 6 problems x 4 samples; pass rates 0, 1/4, 1/2, 3/4, 1, 0 -> sorted (stable, ties by
    # problem order): p0, p5 | p1, p2 | p3, p4.
    correct = np.array(
        [
            [0, 0, 0, 0],
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1],
            [0, 0, 0, 0],
        ],
        bool,
    )
    assert difficulty_buckets(correct).tolist() == [0, 1, 1, 2, 2, 0]
    assert DIFFICULTY_BUCKETS == ("hard", "medium", "easy")
    scores = np.array(
        [
            [0.9, 0.1, 0.1, 0.1],  # hard: 1 false yes
            [0.9, 0.1, 0.1, 0.1],  # medium: 1 true yes
            [0.9, 0.9, 0.9, 0.1],  # medium: 2 true yes, 1 false yes
            [0.1, 0.9, 0.9, 0.1],  # easy: 2 true yes, 1 miss
            [0.9, 0.9, 0.9, 0.9],  # easy: 4 true yes
            [0.1, 0.1, 0.1, 0.1],  # hard: nothing judged yes
        ]
    )
    by = judge_stats_by_bucket(scores, correct)
    hard, medium, easy = by["hard"], by["medium"], by["easy"]
    assert [b["problems"] for b in (hard, medium, easy)] == [2, 2, 2]
    assert (hard["samples"], hard["correct"], hard["judged_yes"], hard["true_pos"]) == (8, 0, 1, 0)
    assert hard["precision"] == 0.0 and hard["recall"] is None  # no correct sample to recall
    assert hard["accuracy"] == pytest.approx(7 / 8)
    assert (medium["correct"], medium["judged_yes"], medium["true_pos"]) == (3, 4, 3)
    assert medium["precision"] == pytest.approx(3 / 4) and medium["recall"] == 1.0
    assert (medium["pass_rate_min"], medium["pass_rate_max"]) == (0.25, 0.5)
    assert (easy["correct"], easy["judged_yes"], easy["true_pos"]) == (7, 6, 6)
    assert easy["precision"] == 1.0 and easy["recall"] == pytest.approx(6 / 7)
    # Near-equal terciles by rank (larger first) even when every pass rate ties.
    assert np.bincount(difficulty_buckets(np.zeros((7, 2), bool))).tolist() == [3, 2, 2]


def test_within_problem_auc_ranks_inside_each_problem():
    """A judge that tells easy from hard problems but ranks each problem's own samples
    backwards: pooled AUC 11/16, within-problem AUC 0 (reranking always picks wrong)."""
    scores = np.array([[0.90, 0.95], [0.10, 0.20], [0.80, 0.85], [0.05, 0.06]])
    correct = np.array([[True, False], [True, False], [True, True], [False, False]])
    # Positives 0.9, 0.1, 0.8, 0.85 vs negatives 0.95, 0.2, 0.05, 0.06: 3 + 2 + 3 + 3 wins.
    assert roc_auc(scores, correct) == pytest.approx(11 / 16)
    assert within_problem_auc(scores, correct).tolist() == [0.0, 0.0]  # rows 2, 3 not mixed
    ties = np.array([[0.3, 0.3, 0.7]])  # correct 0.3 vs wrong 0.3 (1/2) and 0.7 (0)
    assert within_problem_auc(ties, np.array([[True, False, False]])).tolist() == [0.25]
    assert within_problem_auc(np.zeros((2, 3)), np.ones((2, 3), bool)).size == 0
    with pytest.raises(ValueError, match=r"\[P, n\]"):
        within_problem_auc(np.zeros(3), np.zeros(3, bool))


def test_tool_use_stats_by_hand():
    from pipeline.metrics import tool_use_stats

    # 3 episodes (the None row is single-turn): 1, 3 and 2 turns; 0, 2 and 1 calls; the
    # second episode's calls: one timeout, one fine; the third's: malformed.
    stats = tool_use_stats([1, 3, None, 2], [0, 2, None, 1], [[], ["timeout"], None, ["malformed"]])
    assert stats["episodes"] == 3 and stats["mean_turns"] == 2.0
    assert stats["tool_call_rate"] == 2 / 3 and stats["calls_per_episode"] == 1.0
    assert stats["tool_success_rate"] == 1 - 2 / 3
    assert stats["tool_errors"] == {
        "malformed": 1,
        "error": 0,
        "timeout": 1,
        "memory": 0,
        "output_limit": 0,
    }
    assert tool_use_stats([None], [None], [None]) == {}
    assert tool_use_stats([1], [0], [[]])["tool_success_rate"] is None


def test_self_confidence_aggregates_a_samples_own_tokens():
    lps = [[-0.1, -0.2, -0.6], [-1.0], []]
    assert self_confidence(lps, "mean").tolist() == pytest.approx([-0.3, -1.0, -np.inf])
    assert self_confidence(lps, "sum").tolist() == pytest.approx([-0.9, -1.0, -np.inf])
    assert self_confidence(lps, "min").tolist() == pytest.approx([-0.6, -1.0, -np.inf])
    # A tool episode's observation tokens (mask 0) are the environment's, not the policy's.
    masked = self_confidence(lps, "mean", masks=[[1, 0, 1], [0], []])
    assert masked.tolist() == pytest.approx([-0.35, -np.inf, -np.inf])
    # A sample without tokens of its own ranks last in best-of-k.
    assert best_of_k(self_confidence([[], [-5.0]], "mean"), [True, False], 2) is False
    with pytest.raises(ValueError, match="'median' is unknown; allowed"):
        self_confidence(lps, "median")
    with pytest.raises(ValueError, match="2 masks for 3 samples"):
        self_confidence(lps, "mean", masks=[[1, 1, 1], [1]])
    with pytest.raises(ValueError, match="sample 0: 2 mask entries for 3 log-probs"):
        self_confidence(lps, "mean", masks=[[1, 1], [1], []])
