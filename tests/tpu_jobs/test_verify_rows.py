"""tpu_jobs.generate.sample_verify.verify_rows: a repeated (problem, text) pair is verified
once, in the real sandbox, and every copy gets the reward the pair gets on its own."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.sandbox.isolation import userns_forbidden
from pipeline.tasks import TASKS
from pipeline.tasks.arithmetic import ArithmeticOptions
from pipeline.tasks.code_dsl import CodeOptions
from tpu_jobs.generate.sample_verify import distinct_rows, verify_rows

_FORBIDDEN = userns_forbidden()
pytestmark = pytest.mark.skipif(_FORBIDDEN is not None, reason=f"no sandbox here: {_FORBIDDEN}")


class _Recording:
    """The real code family, recording what it was asked to verify."""

    def __init__(self, task):
        self.task, self.calls = task, []

    def __getattr__(self, name):
        return getattr(self.task, name)

    def verify_batch(self, problems, texts):
        self.calls.append(list(zip((p.problem_id for p in problems), texts, strict=True)))
        return self.task.verify_batch(problems, texts)


def test_repeated_pairs_are_verified_once_with_the_same_rewards(monkeypatch):
    code, arithmetic = TASKS["code"], TASKS["arithmetic"]
    rng = np.random.default_rng(0)
    p, q = (code.sample_problem(rng, CodeOptions(max_ops=1)) for _ in range(2))
    a = arithmetic.sample_problem(rng, ArithmeticOptions())
    a_text = arithmetic.teacher_solution(a, rng, ArithmeticOptions(carry_drop_prob=0.0))
    wrong = "x+100"
    problems = [p, p, q, p, q, p, a, a]
    texts = [p.answer, wrong, q.answer, p.answer, q.answer, wrong, a_text, a_text]
    assert distinct_rows(problems, texts) == [0, 1, 2, 0, 2, 1, 6, 6]
    # An equal problem in another object is judged on its own.
    twin = dataclasses.replace(p)
    assert distinct_rows([p, twin, p], ["x", "x", "x"]) == [0, 1, 0]
    recording = _Recording(code)
    monkeypatch.setitem(TASKS, "code", recording)
    rewards = verify_rows(problems, texts)
    # One sandbox call for the family, with the three distinct code pairs only.
    want = [(p.problem_id, p.answer), (p.problem_id, wrong), (q.problem_id, q.answer)]
    assert recording.calls == [want]
    pairs = zip(problems, texts, strict=True)
    alone = [TASKS[pr.task].verify(pr, t) for pr, t in pairs]
    assert rewards == alone == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
