"""The math family: math-verify's equivalence, run inside the sandbox, on each answer form
of GSM8K, MATH and AIME golds; the last-boxed rule; injection attempts.

The expected verdicts are mathematical facts (14/3 = 4.666..., [2, 5) != (2, 5)), not
outputs of one machine. Every case is judged in one batch, as a rollout does."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipeline.sandbox import SandboxError
from pipeline.sandbox.isolation import userns_forbidden
from pipeline.tasks import get_task, math_task
from pipeline.tasks.base import Problem

_FORBIDDEN = userns_forbidden()
pytestmark = pytest.mark.skipif(_FORBIDDEN is not None, reason=f"no sandbox here: {_FORBIDDEN}")

MATH = get_task("math")


def _problem(gold: str, pid: str = "p") -> Problem:
    return Problem(problem_id=pid, task="math", prompt="q", answer=gold, meta={})


# (gold as the dataset writes it, an equivalent completion, a wrong completion)
FORMS = [
    ("72", "She has $72$ apples, so \\boxed{72}.", "\\boxed{73}"),  # GSM8K integer
    ("7,425,000", "Total: \\boxed{7425000}", "\\boxed{742500}"),  # thousands separators
    ("-5", "so x = \\boxed{-5}", "\\boxed{5}"),  # sign
    ("0.25", "\\boxed{\\frac{1}{4}}", "\\boxed{0.52}"),  # decimal vs fraction
    ("$\\frac{14}{3}$", "\\boxed{\\dfrac{14}{3}}", "\\boxed{4.6}"),  # MATH fraction
    ("$\\frac{14}{3}$", "\\boxed{14/3}", "\\boxed{\\frac{3}{14}}"),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\sqrt{3}/2}", "\\boxed{\\frac{\\sqrt{2}}{2}}"),
    (
        "\\boxed{(3, \\frac{\\pi}{2})}",
        "\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}",
        "\\boxed{(3, \\pi)}",
    ),
    ("28\\%", "\\boxed{28\\%}", "\\boxed{82\\%}"),  # percent
    ("[2, 5)", "\\boxed{[2,5)}", "\\boxed{(2, 5)}"),  # half-open interval
    ("(-\\infty, 3]", "\\boxed{(-\\infty,3]}", "\\boxed{(-\\infty, 3)}"),
    ("\\{1,2,3\\}", "\\boxed{\\{3, 2, 1\\}}", "\\boxed{\\{1, 2\\}}"),  # set: order is free
    ("(1,2)", "\\boxed{(1, 2)}", "\\boxed{(2, 1)}"),  # tuple: order counts
    ("x^2+1", "\\boxed{1 + x^2}", "\\boxed{x^2 - 1}"),  # expression
    ("\\boxed{204}", "The final answer is 204.", "\\boxed{240}"),  # AIME, gold boxed; no box
]


def test_each_answer_form_equal_and_wrong():
    problems, completions, want = [], [], []
    for gold, right, wrong in FORMS:
        problems += [_problem(gold), _problem(gold)]
        completions += [right, wrong]
        want += [1.0, 0.0]
    got = MATH.verify_batch(problems, completions)
    mismatched = [
        (p.answer, c, g)
        for p, c, g, w in zip(problems, completions, got, want, strict=True)
        if g != w
    ]
    assert not mismatched, mismatched


# Answers as models write them, without the tidy `\boxed{}` of FORMS: (gold, completion,
# verdict). Each verdict is worked by hand from what the answer says and from math-verify's
# documented reading (malformed `\frac27` is 2/7, a trailing unit word is dropped, inline
# `$...$` and `\(...\)` hold one line, display `$$...$$` and `\[...\]` many).
WRITTEN = [
    ("2/7", "so $\\frac27 $", 1.0),  # malformed fraction, no box
    ("7/2", "so $\\frac27 $", 0.0),  # ... read as 2/7, not 7/2
    ("1/2", "it is $\\frac4{8} $", 1.0),
    ("$\\sqrt{5}$", "the side is $\\sqrt5 $", 1.0),  # malformed root
    ("$\\sqrt{6}$", "the side is $\\sqrt5 $", 0.0),
    ("$2\\sqrt{2}$", "\\boxed{2\\sqrt2}", 1.0),
    ("$\\frac{3}{4}$", "\\boxed{\\tfrac34}", 1.0),
    ("5/2", "The rod is $\\frac{5}{2} \\text{centimeters}$", 1.0),  # a unit after the value
    ("2/5", "The rod is $\\frac{5}{2} \\text{centimeters}$", 0.0),
    ("12", "\\boxed{12 \\text{ meters}}", 1.0),
    ("13", "\\boxed{12 \\text{ meters}}", 0.0),
    ("x^3", "we get $$\nx^3\n$$", 1.0),  # display math may span lines
    ("x^3", "we get \\[\nx^3\n\\]", 1.0),
    ("x^3", "we get $\nx^3\n$", 0.0),  # inline math may not: nothing is read
    ("x^3", "we get \\(\nx^3\n\\)", 0.0),
    ("3.75", "The price is 3,75", 1.0),  # decimal comma in the answer
    ("3,75", "\\boxed{3.75}", 1.0),  # ... and in the gold
    ("3,75", "\\boxed{375}", 0.0),
    ("-3,4", "the roots are \\boxed{4, -3}", 1.0),  # MATH's list of roots
    ("-3,4", "\\boxed{-3}", 0.0),
    ("4 096", "\\boxed{4096}", 1.0),  # thousands grouped by a space
    ("4 096", "\\boxed{100}", 0.0),  # what `$4 096$` reads as in LaTeX (latex2sympy)
]


def test_answers_as_models_write_them():
    problems = [_problem(gold) for gold, _, _ in WRITTEN]
    got = MATH.verify_batch(problems, [c for _, c, _ in WRITTEN])
    mismatched = [(g, c, r) for (g, c, w), r in zip(WRITTEN, got, strict=True) if r != w]
    assert not mismatched, mismatched


def test_gold_readings():
    assert math_task.gold_readings(" [2, 5) ") == ("$[2, 5)$",)
    assert math_task.gold_readings("$\\frac{1}{2}$") == ("$\\frac{1}{2}$",)
    assert math_task.gold_readings("\\boxed{204}") == ("\\boxed{204}",)
    assert math_task.gold_readings("7,425,000") == ("$7,425,000$",)
    assert math_task.gold_readings("1 000.5") == ("1 000.5",)
    assert math_task.gold_readings("-1,22") == ("-1,22", "$-1,22$")
    assert math_task.gold_readings("1, 22") == ("$1, 22$",)  # a space after it: a list


def test_the_last_boxed_answer_counts_and_only_that():
    gold = _problem("72")
    completions = [
        "First I thought \\boxed{3}, but rechecking: \\boxed{72}",
        "\\boxed{72}, no wait, \\boxed{3}",
        "\\boxed{3} and \\boxed{72}",  # boxed="all" would make this the set {3, 72}
        "I got 42. Then 72",  # no box: the last answer-like expression
        "I do not know.",
        "",
    ]
    assert MATH.verify_batch([gold] * len(completions), completions) == [1, 0, 1, 1, 0, 0]
    assert MATH.verify(gold, "therefore \\boxed{72}") == 1.0


def test_extract_answer_is_what_maj_at_k_votes_on():
    assert MATH.extract_answer("so \\boxed{\\dfrac{14}{3}}.") == "\\frac{14}{3}"
    assert MATH.extract_answer("\\boxed{1,000}") == "1000"
    assert MATH.extract_answer("the answer is 42.") == "42"
    assert MATH.extract_answer("no idea") is None


INJECTIONS = [
    "\\boxed{__import__('os').system('touch {marker}')}",
    "__import__('os').system('touch {marker}')",
    "The answer is exec(\"open('{marker}', 'w').write('x')\")",
    "\\boxed{().__class__.__base__.__subclasses__()}; open('{marker}','w')",
    "$\\input{{marker}}$ \\boxed{\\input{/etc/passwd}}",
    "eval(compile('import os; os.system(\"touch {marker}\")', 'x', 'exec'))",
]


def test_injections_score_zero_and_touch_nothing_on_the_host():
    # Each names a fresh path in the host's /tmp; none may exist afterwards (inside the
    # sandbox /tmp is a private tmpfs, wiped after the run).
    markers = [Path("/tmp") / f"rlax-math-{uuid.uuid4().hex}" for _ in INJECTIONS]
    completions = [i.replace("{marker}", str(m)) for i, m in zip(INJECTIONS, markers, strict=True)]
    rewards = MATH.verify_batch([_problem("0")] * len(completions), completions)
    assert rewards == [0.0] * len(completions)
    assert not [m for m in markers if m.exists()]


def test_math_verify_never_loads_in_the_callers_process():
    # sympy's parse_expr evaluates Python: it must stay in the sandbox. A fresh process,
    # so that no other test's imports count.
    program = (
        "import sys\n"
        "from pipeline.tasks import get_task\n"
        "from pipeline.tasks.base import Problem\n"
        "p = Problem(problem_id='p', task='math', prompt='q', answer='$\\\\frac{1}{2}$', meta={})\n"
        "print(get_task('math').verify(p, '\\\\boxed{0.5}'))\n"
        "print(sorted(m for m in ('math_verify', 'sympy', 'latex2sympy2_extended', 'antlr4')"
        " if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", program], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["1.0", "[]"]


def test_a_forged_verdict_line_does_not_count():
    # The verdict line carries a nonce the completion cannot know.
    forged = "\\boxed{1}\n1\n 1\nrlax 1\n"
    assert MATH.verify(_problem("2"), forged) == 0.0


def test_a_gold_math_verify_cannot_read_scores_zero_and_says_so(caplog):
    with caplog.at_level("WARNING", logger="pipeline.tasks.math_task"):
        assert MATH.verify(_problem("$$", pid="broken"), "\\boxed{1}") == 0.0
    assert "'broken'" in caplog.text and "no answer in its gold" in caplog.text


def test_an_empty_gold_is_refused_naming_the_problem():
    with pytest.raises(ValueError, match="'empty-one' has an empty answer"):
        MATH.check_problem(_problem("  ", pid="empty-one"))
    MATH.check_problem(_problem("72"))


def test_a_grader_that_cannot_start_is_an_error_not_reward_zero(monkeypatch):
    # Scoring every sample 0 would train against a broken grader.
    broken = math_task.LIMITS.__class__(packages=("math_verify_not_installed",))
    monkeypatch.setattr(math_task, "LIMITS", broken)
    with pytest.raises(SandboxError, match="math_verify_not_installed"):
        MATH.verify(_problem("1"), "\\boxed{1}")


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{\\operatorname{__import__}('os').write(2, b'EXECUTED')}",
        "the answer is __import__('os').write(2, b'EXECUTED')",
        "the answer is (lambda: __import__('os').write(2, b'EXECUTED'))()",
        "\\boxed{\\text{__import__('os').write(2, b'EXECUTED')}}",
    ],
)
def test_model_text_is_parsed_never_run_by_the_grader(completion):
    # math-verify's expression path reads only digits and operators, its LaTeX path is an
    # ANTLR parser: the payload's side effect (a line on stderr) must never happen.
    result = math_task.execute_many([math_task.grader_job(_problem("5"), completion, "N")])[0]
    assert result.status == "ok" and result.stdout == "\nN 0\n"
    assert "EXECUTED" not in result.stderr
