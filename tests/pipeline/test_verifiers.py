import builtins
import time

import numpy as np
import pytest

from pipeline.tasks import TASKS, expr

ARITH, COUNT = TASKS["arithmetic"], TASKS["countdown"]
ADD = ARITH.make("+", 4567, 123)  # 4690
MUL = ARITH.make("*", 4567, 8)  # 36536
CD = COUNT.make([3, 7, 12], "3*7+12")  # 33
CD24 = COUNT.make([3, 3, 8, 8], "8/(3-8/3)")  # 24 through the fraction 1/3

HOSTILE = [
    "__import__('os').system('rm -rf /')",
    "1+1; import os",
    "(" * 10000,
    ")" * 10000,
    "9**9**9**9",
    "1e308*1e308",
    "2/0",
    "3/(7-7)",
    "lambda: 0",
    "exec('x=1')",
    "eval('1')",
    "\x00",
    "#" * 10000,
    "1" * 1_000_000,
    "\uff14\uff16\uff19\uff10",  # full-width 4690
    "\u200f4690",  # right-to-left mark
    "4690\u200e",  # left-to-right mark
    "\u0664\u0666\u0669\u0660",  # Arabic-Indic digits
    "\U0001f600",
    "4690\U0001f600",
    "NaN",
    "inf",
    "-",
    "",
    " ",
    "\t\n",
]


@pytest.fixture
def no_code_execution(monkeypatch, tmp_path):
    """Make eval/exec/compile/__import__ raise, to prove the verifiers never call them."""

    def boom(*args, **kwargs):
        raise AssertionError(f"code execution attempted with {str(args)[:80]}")

    for name in ("eval", "exec", "compile", "__import__"):
        monkeypatch.setattr(builtins, name, boom)
    return tmp_path


@pytest.mark.parametrize(("task", "problem"), [(ARITH, ADD), (ARITH, MUL), (COUNT, CD)])
def test_hostile_completions_get_reward_in_range_and_execute_nothing(
    no_code_execution, task, problem
):
    witness = no_code_execution / "pwned"
    attacks = HOSTILE + [f"__import__('os').system('touch {witness}')"]
    for text in attacks:
        for completion in (text, "#" + text, "a7+3+0=10#" + text, text + "#", "#4690" + text):
            r = task.verify(problem, completion)
            assert isinstance(r, float) and r in (0.0, 1.0)
            if text and text.strip():
                assert r == 0.0, (completion[:50], r)
    assert not witness.exists()


def test_huge_inputs_are_cheap():
    huge = "a7+3+0=10     " * 75_000  # ~1 MB of plausible text
    t0 = time.perf_counter()
    for task, problem in ((ARITH, ADD), (COUNT, CD)):
        assert task.verify(problem, huge) == 0.0
        assert task.verify(problem, huge + "#") == 0.0
        assert task.verify(problem, "#" + huge) == 0.0
        assert task.verify(problem, "#" + "(" * 1_000_000) == 0.0
    assert (
        ARITH.verify(ADD, huge + "#4690") == 1.0
    )  # a long chain is fine; only the answer is bounded
    assert COUNT.verify(CD, huge + "#3*7+12") == 1.0
    assert time.perf_counter() - t0 < 2.0


def test_non_string_completions_do_not_raise():
    for task, problem in ((ARITH, ADD), (COUNT, CD)):
        for bad in (None, 4690, b"#4690", ["#4690"]):
            assert task.verify(problem, bad) == 0.0  # type: ignore[arg-type]


def test_arithmetic_verifier():
    cases = {
        "#4690": 1.0,
        "a7+3+0=10     b6+2+1=090    c5+1+0=0690   d4+0+0=04690  # 4690": 1.0,
        "# 4690 ": 1.0,  # spaces around the answer are stripped
        "#04690": 1.0,  # a literal with a leading zero still denotes 4690
        "#1#4690": 1.0,  # the last marker wins
        "#4690#1": 0.0,
        "#4680": 0.0,
        "#-4690": 0.0,
        "#46 90": 0.0,
        "#4690.0": 0.0,
        "#+4690": 0.0,
        "#4690,": 0.0,
        "#0x1252": 0.0,
        "#4_690": 0.0,  # int() would accept this; the verifier does not
        "4690": 0.0,  # no marker, no answer
        "#": 0.0,
        "": 0.0,
        "#\uff14\uff16\uff19\uff10": 0.0,  # int() would accept full-width digits too
        "#4690\n": 0.0,
        "#" + "9" * 41: 0.0,
    }
    for completion, reward in cases.items():
        assert ARITH.verify(ADD, completion) == reward, completion
    assert ARITH.verify(MUL, "#36536") == 1.0 and ARITH.verify(MUL, "#6536") == 0.0
    assert ARITH.extract_answer("x#1# 42 ") == "42"
    assert ARITH.extract_answer("42") is None
    assert int("4_690") == 4690 and int("\uff14\uff16\uff19\uff10") == 4690  # why the regex


def test_countdown_verifier():
    cases = {
        "#3*7+12": 1.0,
        "3*7=21,21+12=33#3*7+12": 1.0,
        "#12+7*3": 1.0,  # any order
        "#(3*7)+12": 1.0,  # redundant parentheses
        "#((3)*(7))+((12))": 1.0,
        "# 3 * 7 + 12 ": 1.0,
        "#3*(7+12)": 0.0,  # different parenthesisation, different value
        "#3*7+12+0": 0.0,  # 0 is not a given number
        "#3*7+12-3+3": 0.0,  # 3 reused
        "#7*3+12*1": 0.0,
        "#21+12": 0.0,  # intermediate results are not given numbers
        "#3*7": 0.0,  # 12 unused
        "#3*7+012": 1.0,  # 012 is the number 12
        "#-3*-7+12": 0.0,  # no unary minus
        "#3*7+12=33": 0.0,
        "#3x7+12": 0.0,
        "#3*7+12)": 0.0,
        "#(3*7+12": 0.0,
        "#3**7+12": 0.0,
        "#": 0.0,
        "": 0.0,
    }
    for completion, reward in cases.items():
        assert COUNT.verify(CD, completion) == reward, completion
    # Exact fractions: 8/(3-8/3) = 8/(1/3) = 24; floats would give 23.99999...
    assert COUNT.verify(CD24, "#8/(3-8/3)") == 1.0
    assert COUNT.verify(CD24, "#8/(3-(8/3))") == 1.0
    assert COUNT.verify(CD24, "#(8/(3-8/3))") == 1.0
    assert COUNT.verify(CD24, "#8*3-8*3") == 0.0
    div0 = COUNT.make([3, 7, 7], "3*7+7")
    assert COUNT.verify(div0, "#3/(7-7)") == 0.0
    assert COUNT.verify(div0, "#7/(3-3)+7") == 0.0
    # A different correct solution.
    alt = COUNT.make([2, 3, 4], "2*3*4")
    assert COUNT.verify(alt, "#(2+4)*4") == 0.0 and COUNT.verify(alt, "#4*3*2") == 1.0
    assert COUNT.verify(alt, "#(4/2)*3*2") == 0.0


def test_expression_parser_bounds():
    deep = "(" * expr.MAX_DEPTH + "1" + ")" * expr.MAX_DEPTH
    assert expr.evaluate(expr.parse(deep)) == 1
    for bad, msg in [
        ("(" * (expr.MAX_DEPTH + 1) + "1" + ")" * (expr.MAX_DEPTH + 1), "deeper"),
        ("1+" * 200 + "1", "characters"),
        ("1" * (expr.MAX_NUMBER_DIGITS + 1), "digits"),
        ("1+", "ends too early"),
        ("", "empty"),
        ("()", "expected a number"),
        ("1 2", "unexpected"),
        ("2/0", "division by zero"),
        ("1.5", "character '.'"),
        ("\u0661", "character"),
    ]:
        with pytest.raises(expr.ExprError, match=msg):
            expr.evaluate(expr.parse(bad))
    # The longest allowed left-deep chain evaluates without hitting the recursion limit.
    chain = "1+" * ((expr.MAX_EXPR_CHARS - 1) // 2) + "1"
    assert len(chain) <= expr.MAX_EXPR_CHARS
    assert expr.evaluate(expr.parse(chain)) == (expr.MAX_EXPR_CHARS - 1) // 2 + 1


def test_random_garbage_never_raises():
    rng = np.random.default_rng(0)
    alphabet = list("0123456789+-*/()=#,. ae") + ["\u200f", "\uff11", "\U0001f600", "\n"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 40))))
        for task, problem in ((ARITH, ADD), (COUNT, CD), (COUNT, CD24)):
            assert task.verify(problem, text) in (0.0, 1.0)
