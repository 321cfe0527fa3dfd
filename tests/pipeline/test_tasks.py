import json
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest

from pipeline.config import ConfigError, TaskConfig, from_dict
from pipeline.tasks import TASKS, UnknownTaskError, expr, get_task
from pipeline.tasks.arithmetic import (
    SLIPS,
    ArithmeticOptions,
    ArithmeticTask,
    columns,
    render,
    slipped_columns,
)
from pipeline.tasks.base import Problem, SyntheticTask, problem_id
from pipeline.tasks.code_dsl import CodeOptions
from pipeline.tasks.countdown import CountdownOptions, CountdownTask, slip, solution_text
from pipeline.tasks.long_multiplication import LongMultiplicationOptions
from pipeline.tasks.mix import build_splits

# The teachers without their mistakes.
CLEAN = {
    "arithmetic": ArithmeticOptions(carry_drop_prob=0.0),
    "countdown": CountdownOptions(error_prob=0.0),
    "code": CodeOptions(error_prob=0.0),
    "long_multiplication": LongMultiplicationOptions(digit_error_prob=0.0),
}


def tc(**fields):
    """A TaskConfig from fields in either spelling (`min_digits` or `arithmetic.min_digits`)."""
    return from_dict(TaskConfig, fields)


ARITH: ArithmeticTask = TASKS["arithmetic"]
COUNT: CountdownTask = TASKS["countdown"]
# Families that generate their problems (all of them: code also scores curated problems).
SYNTHETIC = {name: t for name, t in TASKS.items() if isinstance(t, SyntheticTask)}


def ref_carries(op: str, a: int, b: int) -> int:
    """Non-zero carry-outs, re-derived with whole-number arithmetic instead of digits."""
    n = len(str(max(a, b))) if op == "+" else len(str(a))
    k = 0
    for i in range(n):
        mod = 10 ** (i + 1)
        low = (a % mod + b % mod) if op == "+" else (a % mod) * b
        k += low >= mod
    return k


def sample(task, n, seed, cfg=None):
    rng = np.random.default_rng(seed)
    cfg = cfg or TaskConfig()
    return [task.sample_problem(rng, cfg.options_for(task.name)) for _ in range(n)]


# ----------------------------------------------------------------- registry & problems


def test_registry_and_config_validation():
    assert set(TASKS) == {"arithmetic", "countdown", "code", "math", "long_multiplication"}
    assert set(SYNTHETIC) == {"arithmetic", "countdown", "code", "long_multiplication"}
    assert get_task("countdown") is COUNT
    with pytest.raises(
        UnknownTaskError,
        match="'sudoku' is unknown; known families: arithmetic, code, countdown, long_multiplication, "
        "math",
    ):
        get_task("sudoku")
    with pytest.raises(ConfigError, match="task.families"):
        TaskConfig(families=("sudoku",), weights=(1.0,))


def test_problem_dict_round_trip_and_stable_id():
    p = ARITH.make("+", 4567, 123, width=6)
    assert p.problem_id == problem_id("arithmetic", "d4c5b6a7+c1b2a3=")
    assert p.problem_id == ARITH.make("+", 4567, 123, width=6).problem_id
    assert len(p.problem_id) == 16 and int(p.problem_id, 16) >= 0
    assert p.problem_id != ARITH.make("+", 123, 4567).problem_id
    row = json.loads(json.dumps(p.to_dict()))  # JSON-serialisable
    assert Problem.from_dict(row) == p
    assert Problem.from_dict({**row, "meta": json.dumps(row["meta"])}) == p  # Parquet form
    assert p.meta == {"op": "+", "a": 4567, "b": 123, "carries": 1, "width": 6}
    with pytest.raises(ValueError, match="lacks"):
        Problem.from_dict({"task": "arithmetic"})


# ----------------------------------------------------------------- hand-checked formats


def test_arithmetic_hand_checked_completions():
    p = ARITH.make("+", 4567, 123, width=6)
    assert (p.prompt, p.answer) == ("d4c5b6a7+c1b2a3=", "4690")
    rng = np.random.default_rng(0)
    assert ARITH.teacher_solution(p, rng, CLEAN["arithmetic"]) == (
        "a7+3+0=10     b6+2+1=090    c5+1+0=0690   d4+0+0=04690  # 4690"
    )
    p = ARITH.make("+", 99, 1)  # width defaults to the number of columns
    assert p.prompt == "b9a9+a1=" and p.meta["width"] == 2 and p.meta["carries"] == 2
    assert ARITH.teacher_solution(p, rng, CLEAN["arithmetic"]) == "a9+1+0=10 b9+0+1=100#100"
    p = ARITH.make("*", 4567, 8, width=6)
    assert (p.prompt, p.answer) == ("d4c5b6a7*8=", "36536")
    assert ARITH.teacher_solution(p, rng, CLEAN["arithmetic"]) == (
        "a7*8+0=56     b6*8+5=536    c5*8+5=4536   d4*8+4=36536  #36536"
    )
    assert p.meta["carries"] == 4
    # Dropped carries: the chain continues from the dropped carry; the answer follows it.
    drop_first = columns("+", 99, 1, np.array([True, False]))
    assert render("+", *drop_first, 2) == "a9+1+0=10 b9+0+0=090# 90"
    drop_last = columns("+", 99, 1, np.array([False, True]))
    assert render("+", *drop_last, 2) == "a9+1+0=10 b9+0+1=100# 00"
    drop_last = columns("*", 4567, 8, np.array([False, False, False, True]))
    assert render("*", *drop_last, 4) == ("a7*8+0=56   b6*8+5=536  c5*8+5=4536 d4*8+4=36536# 6536")
    assert ARITH.verify(p, render("*", *drop_last, 4)) == 0.0
    with pytest.raises(ValueError, match="width=3 is invalid"):
        ARITH.make("+", 1234, 5, width=3)
    with pytest.raises(ValueError, match="single digit"):
        ARITH.make("*", 1234, 12)


def test_countdown_hand_checked_completions():
    p = COUNT.make([12, 3, 7], "3*7+12")
    assert p.prompt == "3,7,12 to 33:" and p.meta == {"numbers": [3, 7, 12], "target": 33}
    rng = np.random.default_rng(0)
    assert COUNT.teacher_solution(p, rng, CLEAN["countdown"]) == "3*7=21,21+12=33#3*7+12"
    assert solution_text(slip(expr.parse("3*7+12"))) == "3*7=21,21-12=9#3*7-12"
    assert solution_text(expr.parse("16*(17-9)")) == "17-9=8,16*8=128#16*(17-9)"
    # '*' slips to '+', except where that keeps the value (2*2 = 2+2), then to '-'.
    assert solution_text(slip(expr.parse("5*3"))) == "5+3=8#5+3"
    assert solution_text(slip(expr.parse("2*2"))) == "2-2=0#2-2"
    # '/' slips to '-', or to '+' where 4/2 = 4-2.
    assert solution_text(slip(expr.parse("4/2"))) == "4+2=6#4+2"
    always = CountdownOptions(error_prob=0.999999)
    assert COUNT.teacher_solution(p, rng, always) == "3*7=21,21-12=9#3*7-12"
    with pytest.raises(ValueError, match="must use exactly"):
        COUNT.make([3, 7], "3*7+12")


def test_expression_printer_uses_fewest_parentheses_and_keeps_value():
    cases = {
        "(1+2)+3": "1+2+3",
        "1+(2+3)": "1+2+3",
        "1-(2-3)": "1-(2-3)",
        "(1-2)-3": "1-2-3",
        "1*(2/3)": "1*2/3",
        "1/(2*3)": "1/(2*3)",
        "(1+2)*3": "(1+2)*3",
        "1+2*3": "1+2*3",
        "((8))": "8",
        "8/(3-8/3)": "8/(3-8/3)",
    }
    for text, canon in cases.items():
        tree = expr.parse(text)
        assert expr.to_str(tree) == canon
        assert expr.evaluate(expr.parse(canon)) == expr.evaluate(tree)
    assert expr.evaluate(expr.parse("8/(3-8/3)")) == Fraction(24)


# ----------------------------------------------------------------- sampling & splits


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_sampling_is_deterministic_in_the_seed(name):
    a = [p.problem_id for p in sample(TASKS[name], 50, seed=3)]
    assert a == [p.problem_id for p in sample(TASKS[name], 50, seed=3)]
    assert a != [p.problem_id for p in sample(TASKS[name], 50, seed=4)]


def test_splits_deterministic_disjoint_unique_and_weighted():
    cfg = TaskConfig(num_train=3000, num_eval=400, seed=5)
    train, ev = build_splits(cfg)
    assert len(train) == 3000 and len(ev) == 400
    train2, ev2 = build_splits(cfg)
    assert [p.problem_id for p in train] == [p.problem_id for p in train2]
    assert [p.problem_id for p in ev] == [p.problem_id for p in ev2]
    other, _ = build_splits(TaskConfig(num_train=3000, num_eval=400, seed=6))
    assert len({p.problem_id for p in train} & {p.problem_id for p in other}) < 100
    ids_t, ids_e = [p.problem_id for p in train], [p.problem_id for p in ev]
    assert len(set(ids_t)) == len(ids_t) and len(set(ids_e)) == len(ids_e)
    assert not set(ids_t) & set(ids_e)
    assert not {p.prompt for p in train} & {p.prompt for p in ev}
    # Family shares: binomial sd is sqrt(.75*.25/3400) = 0.0074; allow 4 sd.
    share = np.mean([p.task == "arithmetic" for p in train + ev])
    assert abs(share - 0.75) < 0.03
    only = TaskConfig(families=("countdown",), weights=(1.0,), num_train=200, num_eval=20)
    assert {p.task for p in sum(build_splits(only), [])} == {"countdown"}


def test_splits_fail_clearly_when_the_space_is_too_small():
    cfg = tc(
        families=("arithmetic",),
        weights=(1.0,),
        min_digits=1,
        max_digits=1,
        num_train=200,
        num_eval=10,
    )
    with pytest.raises(ValueError, match="distinct train problems"):
        build_splits(cfg)


def test_arithmetic_sampling_distribution():
    cfg = tc(min_digits=2, max_digits=6)
    probs = sample(ARITH, 4000, seed=11, cfg=cfg)
    adds = [p for p in probs if p.meta["op"] == "+"]
    assert abs(len(adds) / len(probs) - 0.7) < 0.03
    lengths = np.array([len(str(p.meta["a"])) for p in probs])
    assert lengths.min() == 2 and lengths.max() == 6
    # Length weights (L-1)^2 over 2..6: P(6) = 25/55.
    assert abs(np.mean(lengths == 6) - 25 / 55) < 0.03
    for p in probs:
        assert p.meta["carries"] == ref_carries(p.meta["op"], p.meta["a"], p.meta["b"])
        assert 2 <= p.meta["b"] <= 9 or p.meta["op"] == "+"


# ----------------------------------------------------------------- teachers


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_error_free_teacher_always_verifies(name):
    task = TASKS[name]
    rng = np.random.default_rng(1)
    # The final answer: the arithmetic result, countdown's expression, code's program.
    answer = {
        "arithmetic": lambda p, text: p.answer,
        "countdown": lambda p, text: text.split("#")[-1],
        "code": lambda p, text: text + "\n",
        "long_multiplication": lambda p, text: p.answer,
    }[name]
    for cfg in (TaskConfig(), tc(min_digits=1, max_digits=8, countdown_numbers=5)):
        problems = sample(task, 1000, seed=2, cfg=cfg)
        texts = [task.teacher_solution(p, rng, CLEAN[name]) for p in problems]
        # One batch: the code family runs each in the sandbox.
        assert task.verify_batch(problems, texts) == [1.0] * len(problems)
        for p, text in zip(problems, texts, strict=True):
            assert task.extract_answer(text) == answer(p, text)


def test_noisy_arithmetic_teacher_error_rate_matches_the_carry_counts():
    p_drop = 0.4
    sft = ArithmeticOptions(carry_drop_prob=p_drop)
    probs = sample(ARITH, 2000, seed=12)
    rng = np.random.default_rng(13)
    correct = np.array([ARITH.verify(p, ARITH.teacher_solution(p, rng, sft)) for p in probs])
    k = np.array([ref_carries(p.meta["op"], p.meta["a"], p.meta["b"]) for p in probs])
    expected = (1 - p_drop) ** k
    # sd of the mean of 2000 Bernoullis <= 0.011; 4 sd.
    assert abs(correct.mean() - expected.mean()) < 0.045
    assert np.all(correct[k == 0] == 1.0)
    for kk in (3, 5):  # per carry count too
        sel = k == kk
        sd = np.sqrt((1 - p_drop) ** kk * (1 - (1 - p_drop) ** kk) / sel.sum())
        assert sel.sum() > 100 and abs(correct[sel].mean() - (1 - p_drop) ** kk) < 4 * sd


def test_arithmetic_slips_hand_checked():
    # 57+68: a7+8+0=15, b5+6+1=12 -> 125. Each slip is carried through the later columns.
    assert render("+", *columns("+", 57, 68), 2) == "a7+8+0=15 b5+6+1=125#125"
    assert render("+", *slipped_columns("+", 57, 68, 0, "digit", 1), 2) == (
        "a7+8+0=16 b5+6+1=126#126"
    )
    assert render("+", *slipped_columns("+", 57, 68, 0, "carry", 1), 2) == (
        "a7+8+0=05 b5+6+0=115#115"
    )
    assert render("+", *slipped_columns("+", 57, 68, 0, "operand", 1), 2) == (
        "a8+8+0=16 b5+6+1=126#126"
    )
    assert render("+", *slipped_columns("+", 57, 68, 1, "operand", 2), 2) == (
        "a7+8+0=15 b7+6+1=145#145"
    )
    # '*' carries are 0..8: 4567*8's first carry 5 + 5 -> 1 (mod 9), then 6*8+1 = 49.
    assert render("*", *slipped_columns("*", 4567, 8, 0, "carry", 5), 4) == (
        "a7*8+0=16   b6*8+1=496  c5*8+4=4496 d4*8+4=36496#36496"
    )


def test_arithmetic_slipped_solutions_are_consistent_and_mostly_wrong():
    """A digit slip at column i moves the answer by exactly (u' - u) * 10^i; every slip
    keeps the fixed-width format; the verifier grades ~90% of them wrong (a carry slip
    can cancel out, and an answer slip is the only inconsistent chain)."""
    rng = np.random.default_rng(3)
    wrong = 0
    problems = sample(ARITH, 400, seed=4)
    for p in problems:
        op, a, b, width = p.meta["op"], p.meta["a"], p.meta["b"], p.meta["width"]
        steps, _ = columns(op, a, b)
        at, delta = int(rng.integers(len(steps))), int(rng.integers(1, 10))
        u = steps[at][4]
        slipped = render(op, *slipped_columns(op, a, b, at, "digit", delta), width)
        moved = ((u + delta) % 10 - u) * 10**at
        assert int(slipped.split("#")[1]) == int(p.answer) + moved
        text = ARITH.slipped_solution(p, rng, CLEAN["arithmetic"])
        assert len(text) == len(ARITH.teacher_solution(p, rng, CLEAN["arithmetic"]))
        wrong += ARITH.verify(p, text) < 1.0
    assert 0.85 < wrong / len(problems) < 0.97
    assert SLIPS == ("operand", "digit", "carry", "answer")


def test_wrong_arithmetic_teacher_misses_by_exactly_the_dropped_carries():
    # The chain stays consistent: answer = true answer - sum of dropped carries' values.
    rng = np.random.default_rng(14)
    for p in sample(ARITH, 300, seed=15):
        op, a, b = p.meta["op"], p.meta["a"], p.meta["b"]
        drop = rng.random(len(str(max(a, b))) if op == "+" else len(str(a))) < 0.5
        steps, carry = columns(op, a, b, drop)
        lost = sum(t * 10 ** (i + 1) for i, (_, _, _, t, _) in enumerate(steps) if drop[i])
        answer = int(render(op, steps, carry, p.meta["width"]).split("#")[1])
        assert answer == int(p.answer) - lost


def test_noisy_countdown_teacher_error_rate():
    sft = CountdownOptions(error_prob=0.3)
    probs = sample(COUNT, 2000, seed=16)
    rng = np.random.default_rng(17)
    wrong = np.mean([COUNT.verify(p, COUNT.teacher_solution(p, rng, sft)) == 0.0 for p in probs])
    assert abs(wrong - 0.3) < 0.045  # every slip is wrong; sd 0.010


def test_countdown_problems_are_well_formed():
    for k in (2, 3, 5):
        for p in sample(COUNT, 300, seed=k, cfg=tc(countdown_numbers=k)):
            nums, target = p.meta["numbers"], p.meta["target"]
            assert len(nums) == k and nums == sorted(nums) and all(1 <= n <= 50 for n in nums)
            assert 1 <= target <= 999 and sum(n > 20 for n in nums) <= 1
            tree = expr.parse(p.answer)
            assert sorted(expr.numbers(tree)) == nums and expr.evaluate(tree) == target
            for _, _, _, r in expr.steps(tree):  # integer, positive intermediate results
                assert r.denominator == 1 and 0 < r <= 999


@pytest.mark.parametrize(
    "cfg",
    [
        TaskConfig(),
        tc(max_digits=8, countdown_numbers=5),
        tc(min_digits=1, max_digits=3, countdown_numbers=2),
    ],
)
def test_completions_fit_max_completion_chars(cfg):
    rng = np.random.default_rng(18)
    for name, task in SYNTHETIC.items():
        limit = task.max_completion_chars(cfg.options_for(name))
        lengths = [
            len(task.teacher_solution(p, rng, s))
            for p in sample(task, 500, seed=19, cfg=cfg)
            for s in (
                CLEAN[name],
                replace(cfg.options_for(name), **dict.fromkeys(task.NOISE_FIELDS, 0.5)),
            )
        ]
        assert max(lengths) <= limit, (name, max(lengths), limit)
    # Default arithmetic at 6 digits: at most 92 characters (+ EOS <= 96 new tokens).
    assert ARITH.max_completion_chars(ArithmeticOptions()) == 92
    longest = ARITH.make("+", 999999, 999999, width=6)
    assert len(ARITH.teacher_solution(longest, rng, CLEAN["arithmetic"])) == 92


def test_arithmetic_rejects_more_columns_than_place_letters():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="task.arithmetic.max_digits=27 is too large"):
        ARITH.sample_problem(rng, ArithmeticOptions(max_digits=27))
    p = ARITH.sample_problem(rng, ArithmeticOptions(min_digits=26, max_digits=26))
    assert p.meta["width"] == 26 and p.prompt.startswith("z")
    assert ARITH.verify(p, ARITH.teacher_solution(p, rng, CLEAN["arithmetic"])) == 1.0
