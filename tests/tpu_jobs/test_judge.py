"""tpu_jobs/model/judge.py self-scores against two independent full-sequence forwards."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.config import ModelConfig
from pipeline.tasks.judge import JUDGE_SUFFIX
from pipeline.tokenizer import get_tokenizer
from tests.tpu_jobs.random_weights import random_model
from tpu_jobs.model.batching import pack_rows
from tpu_jobs.model.judge import (
    SCORE_WIDTH,
    judge_batches,
    judge_sequences,
    self_scores,
    suffix_ids,
    verdict_ids,
    verdict_logprobs,
)
from tpu_jobs.model.transformer import sequence_logprobs

CFG = ModelConfig(preset="tiny", tie_embeddings=False)
TOK = get_tokenizer("char")


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=3, std=0.3, norm_std=0.1)


def _cases():
    prompts = [
        TOK.encode_prompt("12+34="),
        TOK.encode_prompt("7*8="),
        TOK.encode_prompt("countdown 3 4 5 to 17:"),
        TOK.encode_prompt("1+1="),
    ]
    solutions = [
        TOK.encode_completion("46#46"),  # finished (ends with EOS)
        TOK.encode("56#5"),  # unfinished (no EOS)
        TOK.encode_completion("3*4=12,12+5=17#17"),
        TOK.encode_completion(""),  # only EOS
    ]
    return prompts, solutions


def _reference(model, prompt, context):
    """log p(y) and log p(n) from two forwards over the whole sequence + verdict token."""
    out = []
    for v in verdict_ids(TOK):
        seq = [*prompt, *context, v]
        tokens, mask, _ = pack_rows([seq], [[]], 64, 0)
        lp = np.asarray(sequence_logprobs(model, tokens, mask))
        out.append(float(lp[0, -1]))
    return np.asarray(out)


def test_judge_sequences_end_the_solution_with_one_eos_and_append_suffix():
    prompts, solutions = _cases()
    ps, cs = judge_sequences(TOK, prompts, solutions)
    assert ps == prompts
    suffix = suffix_ids(TOK)
    assert TOK.decode(suffix) == JUDGE_SUFFIX
    # A solve demonstration's solution ends with EOS, so a judged one does too: the
    # sampled EOS is kept, and a sample cut off without one gets it.
    eos = TOK.eos_id
    assert cs[0] == [*TOK.encode("46#46"), eos, *suffix]
    assert cs[1] == [*TOK.encode("56#5"), eos, *suffix]  # cut off: EOS added
    assert cs[3] == [eos, *suffix]
    assert all(c.count(eos) == 1 for c in cs)
    with pytest.raises(ValueError, match="one solution per prompt"):
        judge_sequences(TOK, prompts, solutions[:2])


def test_self_scores_match_two_full_forwards(model):
    prompts, solutions = _cases()
    _, contexts = judge_sequences(TOK, prompts, solutions)
    lp = verdict_logprobs(model, TOK, prompts, solutions, batch_size=8)
    scores = self_scores(model, TOK, prompts, solutions, batch_size=8)
    for i, (p, c) in enumerate(zip(prompts, contexts, strict=True)):
        ref = _reference(model, p, c)
        np.testing.assert_allclose(lp[i], ref, atol=1e-5)
        py, pn = np.exp(ref)
        np.testing.assert_allclose(scores[i], py / (py + pn), atol=1e-5)
    assert scores.shape == (4,) and scores.dtype == np.float32
    assert np.all((scores > 0) & (scores < 1))
    # The random model must not give every row the same score (the test would be vacuous).
    assert np.ptp(scores) > 1e-3


def test_scores_do_not_depend_on_batch_companions(model):
    prompts, solutions = _cases()
    together = self_scores(model, TOK, prompts, solutions, batch_size=4)
    chunked = self_scores(model, TOK, prompts, solutions, batch_size=3)  # 3 + 1 (filler rows)
    alone = np.concatenate(
        [
            self_scores(model, TOK, [p], [s], batch_size=4)
            for p, s in zip(prompts, solutions, strict=True)
        ]
    )
    # A long companion widens the packed shape of the others.
    long_p, long_s = TOK.encode_prompt("9" * 40), TOK.encode_completion("1" * 50)
    widened = self_scores(model, TOK, [*prompts, long_p], [*solutions, long_s], batch_size=8)[:4]
    for other in (chunked, alone, widened):
        np.testing.assert_allclose(other, together, atol=1e-5)
    # A finished solution and the same solution without its EOS are judged identically.
    no_eos = [s[:-1] if s and s[-1] == TOK.eos_id else s for s in solutions]
    np.testing.assert_allclose(self_scores(model, TOK, prompts, no_eos), together, atol=1e-6)


def test_wide_rows_come_fewer_to_a_batch():
    """rows x (prompt + context width)^2 <= batch_size x SCORE_WIDTH^2, width in buckets of
    16, 32, 64, 128, 256, 512, 1024, ...: the budget of 4 rows is 4 x 256^2 = 262,144."""
    assert SCORE_WIDTH == 256
    buckets = (16, 32, 64, 128, 256, 512)
    short = ([1] * 100, [1] * 20)  # 128 + 32 = 160 wide: 4 x 160^2 fits
    wide = ([1] * 1000, [1] * 20)  # 1024 + 32 = 1056: one row is over the budget alone
    mid = ([1] * 300, [1] * 20)  # 512 + 32 = 544: 1 x 544^2 = 295,936 > 262,144 too
    rows = [short] * 6 + [wide, wide] + [short] * 2 + [mid]
    prompts, contexts = [r[0] for r in rows], [r[1] for r in rows]
    got = judge_batches(prompts, contexts, 4, buckets)
    assert got == [(0, 4), (4, 6), (6, 7), (7, 8), (8, 10), (10, 11)]
    # Within the budget, batch_size rows as before (the demos' widths are <= 256).
    assert judge_batches(prompts[:6], contexts[:6], 4, buckets) == [(0, 4), (4, 6)]
    half = ([1] * 200, [1] * 20)  # 256 + 32 = 288: 3 x 288^2 = 248,832 fits, 4 do not
    assert judge_batches([half[0]] * 4, [half[1]] * 4, 4, buckets) == [(0, 3), (3, 4)]


def test_empty_input(model):
    assert self_scores(model, TOK, [], []).shape == (0,)
