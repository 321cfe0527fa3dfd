"""The self-verification format shared by Self-PRM scoring, the ORM and learning-to-judge.

A judged sequence is the problem's prompt, the solution being judged (its completion text,
then EOS whether or not the sample wrote one), the verification suffix `JUDGE_SUFFIX`, then
one verdict character: `VERDICT_YES` ("this solution is correct") or `VERDICT_NO`, then
EOS. In token ids:

    [BOS] prompt | solution EOS | JUDGE_SUFFIX | verdict [EOS]

Why the EOS before the suffix: a solve demonstration ends its solution with EOS, so a
judging demonstration must too. Without it the two share every token up to the end of the
solution and then disagree (EOS against the suffix), and SFT with judging demonstrations
taught the solver to write ";o" after its answer, as often as `sft.judge_fraction`: 25% of
the base's samples in benchmarks/results/selfprm.md, every one graded wrong, and the
judge's most frequent wrong pick (a correct chain with ";o" after it).

The self-score of a solution is the model's probability of the "yes" verdict at the
verdict position, renormalised over the two verdicts: p(y) / (p(y) + p(n)). Every
character here is in the char tokenizer's CHARSET, so the format needs no new ids.

Pure Python: the token-level work lives in `tpu_jobs/model/judge.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

JUDGE_SUFFIX = ";ok?"
VERDICT_YES = "y"
VERDICT_NO = "n"


def verdict_text(correct: bool) -> str:
    """The verdict a perfect judge writes for a solution whose correctness is `correct`."""
    return VERDICT_YES if correct else VERDICT_NO


def judge_context(solution_ids: Sequence[int], suffix_ids: Sequence[int], eos_id: int) -> list[int]:
    """The completion-side context of a judged solution: its ids ending in one EOS (a
    finished sample ends with EOS; an unfinished one gets it here) plus the suffix ids."""
    ids = list(solution_ids)
    if ids and ids[-1] == eos_id:
        ids = ids[:-1]
    return [*ids, eos_id, *suffix_ids]


def parse_verdict(text: str) -> bool | None:
    """The verdict of a generated judgement: True for "y", False for "n", None for anything
    else (the first non-space character decides; the rest is ignored)."""
    s = text.strip()
    if not s:
        return None
    return {VERDICT_YES: True, VERDICT_NO: False}.get(s[0])


def judge_reward(verdict_text_generated: str, solution_correct: bool) -> float:
    """Learning-to-judge reward: 1 if the verdict matches the verifier's grade, else 0
    (an unparseable verdict earns 0)."""
    v = parse_verdict(verdict_text_generated)
    return float(v is not None and v == solution_correct)
