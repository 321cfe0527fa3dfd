"""The long-multiplication family with a Python tool (pipeline/tasks/long_multiplication.py):
problems, the teacher's two paths against hand-written transcripts, the observation it
writes against the one the real Python tool appends, the verifier, and SFT's loss mask."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.environments.python_tool import PythonTool
from pipeline.sandbox.isolation import userns_forbidden
from pipeline.tasks import get_task
from pipeline.tasks.long_multiplication import LongMultiplicationOptions
from pipeline.tokenizer import CharTokenizer
from tpu_jobs.sft import piece_ids

TASK = get_task("long_multiplication")
ALWAYS_TOOL = LongMultiplicationOptions(tool_prob=1.0)
NEVER_TOOL = LongMultiplicationOptions(tool_prob=0.0)
_FORBIDDEN = userns_forbidden()


def test_problems_have_fixed_length_operands_and_products():
    rng = np.random.default_rng(0)
    problems = [TASK.sample_problem(rng, LongMultiplicationOptions()) for _ in range(300)]
    for p in problems:
        a, b = p.meta["a"], p.meta["b"]
        assert p.prompt == f"{a}*{b}=" and p.answer == str(a * b)
        assert len(str(a)) == len(str(b)) == 3 and len(p.answer) == 6
    assert len({p.problem_id for p in problems}) == 300


def test_teacher_with_the_tool_writes_the_call_the_observation_and_the_answer():
    p = TASK.make(347, 862)
    pieces = TASK.teacher_pieces(p, np.random.default_rng(0), ALWAYS_TOOL)
    assert pieces == [
        ("```python\nprint(347*862)\n```\n", True),
        ("```output\n299114\n```\n", False),
        ("#299114", True),
    ]
    assert TASK.teacher_solution(p, np.random.default_rng(0), ALWAYS_TOOL) == "".join(
        text for text, _ in pieces
    )
    assert TASK.verify(p, "".join(text for text, _ in pieces)) == 1.0
    assert len("".join(t for t, _ in pieces)) <= TASK.max_completion_chars(ALWAYS_TOOL)


def test_teacher_by_hand_slips_digits_at_the_configured_rate():
    rng = np.random.default_rng(1)
    p = TASK.make(347, 862)
    texts = [TASK.teacher_solution(p, rng, NEVER_TOOL) for _ in range(4000)]
    assert all(t.startswith("#") and len(t) == 7 for t in texts)
    wrong_digits = np.mean([a != b for t in texts for a, b in zip(t[1:], "299114", strict=True)])
    assert abs(wrong_digits - 0.3) < 0.02  # 24,000 digits: 4 sd is 0.012
    clean = TASK.noiseless(NEVER_TOOL)
    assert TASK.teacher_solution(p, rng, clean) == "#299114"


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("#299114", 1.0),
        ("```python\nprint(347*862)\n```\n```output\n299114\n```\n#299114", 1.0),
        ("```python\nprint(347*862)\n```\n```output\n299114\n```\n", 0.0),  # no answer
        ("#299114\n", 0.0),
        ("#２９９１１４", 0.0),
        ("#299115", 0.0),
    ],
)
def test_the_verifier_reads_only_the_answer_after_the_last_marker(completion, reward):
    assert TASK.verify(TASK.make(347, 862), completion) == reward


def test_invalid_problems_are_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="same number of digits"):
        TASK.make(100, 100)  # product 10000: 5 digits, not 6
    with pytest.raises(ValueError, match="task.long_multiplication.digits"):
        LongMultiplicationOptions(digits=1)


@pytest.mark.skipif(_FORBIDDEN is not None, reason=f"no sandbox: {_FORBIDDEN}")
def test_the_teacher_observation_is_what_the_python_tool_appends():
    tool = PythonTool(observation_chars=64, timeout_s=5.0, memory_mb=256)
    p = TASK.make(347, 862)
    call, out, _ = TASK.teacher_pieces(p, np.random.default_rng(0), ALWAYS_TOOL)
    step = tool.step(call[0])
    assert (step.observation, step.called, step.error) == (out[0], True, None)


def test_sft_masks_the_observation_tokens():
    tok = CharTokenizer()
    p = TASK.make(347, 862)
    pieces = TASK.teacher_pieces(p, np.random.default_rng(0), ALWAYS_TOOL)
    ids, mask = piece_ids(tok, pieces)
    assert ids == tok.encode("".join(t for t, _ in pieces))
    n_call, n_out = len(pieces[0][0]), len(pieces[1][0])
    assert mask == [1] * n_call + [0] * n_out + [1] * len("#299114")
