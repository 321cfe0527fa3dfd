"""benchmarks/judge_ceiling.py: process labels (which step of an arithmetic chain is wrong)
and the joint score of a sample's likelihood and its verdict."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from judge_ceiling import joint_scores, step_prefixes  # noqa: E402

PROMPT = "d9c3b2a9+d9c9b9a1="  # 9329 + 9991 = 19320: carries out of every column
STEPS = ["a9+1+0=10   ", "b2+9+1=120  ", "c3+9+1=1320 ", "d9+9+1=19320"]


def labels(steps: list[str], answer: str) -> list[bool]:
    text = "".join(steps) + answer
    out = step_prefixes(PROMPT, text, 4)
    assert [prefix for prefix, _ in out] == [
        *("".join(steps[: i + 1]) for i in range(len(steps))),
        text,
    ]
    return [ok for _, ok in out]


def test_a_correct_chain_is_consistent_at_every_step():
    assert labels(STEPS, "#19320") == [True] * 5


def test_a_dropped_carry_is_the_next_step_s_error_only():
    # b takes carry 0 where a wrote 1; b..d are consistent with their own carry-ins.
    steps = [STEPS[0], "b2+9+0=110  ", "c3+9+1=1310 ", "d9+9+1=19310"]
    assert labels(steps, "#19310") == [True, False, True, True, True]


def test_a_wrong_digit_and_a_miscopied_answer_are_flagged_where_they_are():
    steps = [STEPS[0], "b2+9+1=130  ", "c3+9+1=1330 ", "d9+9+1=19330"]  # 2+9+1 is 12, not 13
    assert labels(steps, "#19330") == [True, False, True, True, True]
    assert labels(STEPS, "#19420") == [True, True, True, True, False]
    cut = "".join(STEPS[:2])  # a sample cut off after two steps
    assert [ok for _, ok in step_prefixes(PROMPT, cut, 4)] == [True, True, False, False, False]


def test_the_joint_score_adds_the_verdict_s_log_to_the_summed_log_probs():
    conf = np.array([[-0.5, -0.1]])  # mean log-prob per token
    lengths = np.array([[4.0, 10.0]])
    verdict = np.array([[0.5, 0.01]])
    scores = joint_scores(conf, lengths, verdict, "mean")
    # sums -2.0 and -1.0; plus log 0.5 and log 0.01
    whole = scores['log P(solution, "y")']
    assert whole[0, 0] == pytest.approx(-2.0 + math.log(0.5))
    assert whole[0, 1] == pytest.approx(-1.0 + math.log(0.01))
    per_token = scores['log P(solution, "y") per token']
    assert per_token[0] == pytest.approx([(-2.0 + math.log(0.5)) / 5, (-1.0 + math.log(0.01)) / 11])
    # the likelihood alone picks sample 1; its verdict (0.01) moves the joint pick to 0
    assert np.argmax(scores["self-confidence alone (mean)"][0]) == 1
    assert np.argmax(whole[0]) == 0
    # a run that stored sums needs no lengths; one that stored minima has no sum
    summed = joint_scores(conf * lengths, lengths, verdict, "sum")['log P(solution, "y")']
    assert summed == pytest.approx(whole)
    with pytest.raises(ValueError, match="'min'"):
        joint_scores(conf, lengths, verdict, "min")
