"""The code family's DSL generator and noisy teacher, checked in the real sandbox and
against a brute-force enumeration written with plain Python integers."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from pipeline.errors import ConfigError
from pipeline.tasks import TASKS, code_dsl
from pipeline.tasks.base import make_problem
from pipeline.tasks.code_dsl import CodeOptions
from pipeline.tokenizer import CHARSET

CODE = TASKS["code"]
CLEAN = CodeOptions(error_prob=0.0)
WIDE = CodeOptions(max_const=20, examples=10, tests=10)

# The DSL's semantics again, as Python's own operators (the reference for NumPy's).
PY_OPS = {
    "add": lambda x, c: x + c,
    "sub": lambda x, c: x - c,
    "mul": lambda x, c: x * c,
    "div": lambda x, c: x // c,
    "mod": lambda x, c: x % c,
    "max": max,
    "min": min,
    "absdiff": lambda x, c: abs(x - c),
}


def py_eval(program, x: int) -> int:
    for name, c in program:
        x = PY_OPS[name](x, c)
    return x


def sample(n: int, seed: int, options: CodeOptions | None = None):
    rng = np.random.default_rng(seed)
    return [CODE.sample_problem(rng, options or CodeOptions()) for _ in range(n)]


def test_code_is_a_synthetic_family_with_a_config_section():
    from pipeline.config import load_config

    assert CODE.name == "code" and CODE.NOISE_FIELDS == ("error_prob",)
    cfg = load_config(None, extra={"task": {"families": ["code"], "weights": [1.0]}})
    assert cfg.task.options_for("code") == CodeOptions()


def test_sampling_is_deterministic_in_the_seed():
    a = [p.to_dict() for p in sample(200, seed=3)]
    assert a == [p.to_dict() for p in sample(200, seed=3)]
    assert [p["problem_id"] for p in a] != [p.problem_id for p in sample(200, seed=4)]


def test_prompt_shows_the_examples_and_ends_with_the_header():
    for p in sample(300, seed=5, options=WIDE):
        program = code_dsl.parse_program(p.meta["program"])
        pairs, header = p.prompt.split("; ", 1)
        assert header == p.meta["prefix"] == "def f(x): return "
        shown = []
        for pair in pairs.split(";"):
            call, value = pair.split("=")
            x = int(call.removeprefix("f(").removesuffix(")"))
            assert int(value) == py_eval(program, x)
            shown.append(x)
        assert shown[:3] == [0, 1, 2] and shown == sorted(set(shown)) and len(shown) == 10
        hidden = p.meta["hidden"]
        assert len(hidden) == 10 and not set(hidden) & set(shown)
        assert all(0 <= x < code_dsl.DOMAIN for x in shown + hidden)
        assert p.answer == code_dsl.render(program)


def test_rendered_programs_compute_the_dsl_semantics():
    # Python's eval of the rendered text against the plain-integer reference: parentheses
    # and precedence are right, and NumPy's // and % floor as Python's do (x < 0 inside).
    ops = code_dsl.single_ops(5)
    for program in [(o,) for o in ops] + list(itertools.product(ops, repeat=2)):
        fn = eval(f"lambda x: {code_dsl.render(program)}")  # trusted: our own rendering
        xs = range(-3, 12)
        assert [fn(x) for x in xs] == [py_eval(program, x) for x in xs], program
        assert code_dsl.evaluate(program, np.arange(-3, 12)).tolist() == [fn(x) for x in xs]


def test_examples_identify_the_answer_by_brute_force():
    # Every program of at most as many operations that fits the shown examples gives the
    # same hidden outputs, and no shorter one fits them.
    options = CodeOptions(max_const=4)
    ops = code_dsl.single_ops(4)
    every = [(o,) for o in ops] + list(itertools.product(ops, repeat=2))
    for p in sample(60, seed=6, options=options):
        program = code_dsl.parse_program(p.meta["program"])
        shown = [
            int(s.split(")")[0].removeprefix("f(")) for s in p.prompt.split("; ")[0].split(";")
        ]
        hidden = p.meta["hidden"]
        for other in every:
            if len(other) > len(program):
                continue
            if all(py_eval(other, x) == py_eval(program, x) for x in shown):
                assert len(other) == len(program), (p.answer, other)
                assert all(py_eval(other, x) == py_eval(program, x) for x in hidden)


def test_canonical_programs_pass_in_the_sandbox_and_slips_fail():
    problems = sample(400, seed=7) + sample(100, seed=8, options=WIDE)
    assert CODE.verify_batch(problems, [p.answer for p in problems]) == [1.0] * len(problems)
    rng = np.random.default_rng(9)
    clean = [CODE.teacher_solution(p, rng, CLEAN) for p in problems]
    assert clean == [p.answer for p in problems]
    # A teacher that almost always slips: every program it changes fails.
    noisy = [replace(CodeOptions(), error_prob=0.999)] * 400 + [
        replace(WIDE, error_prob=0.999)
    ] * 100
    texts = [CODE.teacher_solution(p, rng, o) for p, o in zip(problems, noisy, strict=True)]
    rewards = CODE.verify_batch(problems, texts)
    for p, text, reward in zip(problems, texts, rewards, strict=True):
        assert (reward == 1.0) == (text == p.answer), (p.answer, text)
    assert np.mean(rewards) < 0.01
    # The whole completion is also a program when the model writes the header itself.
    assert CODE.verify(problems[0], "def f(x): return " + problems[0].answer) == 1.0


def test_noisy_teacher_error_rate_on_one_operation_problems():
    problems = sample(600, seed=10, options=CodeOptions(max_ops=1))
    rng = np.random.default_rng(11)
    texts = [CODE.teacher_solution(p, rng, CodeOptions(error_prob=0.3)) for p in problems]
    wrong = 1.0 - np.mean(CODE.verify_batch(problems, texts))
    assert abs(wrong - 0.3) < 0.06  # every slip is wrong; sd 0.019


def test_off_by_one_teacher_writes_the_constant_plus_one_and_nothing_else():
    """`slip: off_by_one`: a slipped program is the canonical one with its constant + 1 (- 1
    at max_const), it fails in the sandbox, and it is written exactly when the error coin
    falls and + 1 changes f at a hidden input (checked here with plain Python integers)."""
    options = CodeOptions(max_ops=1, error_prob=0.5, slip="off_by_one")
    problems = sample(600, seed=16, options=options)
    rng = np.random.default_rng(17)
    coins = np.random.default_rng(17)  # the teacher draws (coin, pick) per operation
    texts, expected = [], []
    for p in problems:
        texts.append(CODE.teacher_solution(p, rng, options))
        coin, _ = coins.random(1)[0], coins.random(1)[0]
        ((name, c),) = p.meta["program"]
        wrong = c + 1 if c + 1 <= options.max_const else c - 1
        slipped = ((name, wrong),)
        changes = any(py_eval(slipped, x) != py_eval(((name, c),), x) for x in p.meta["hidden"])
        expected.append(code_dsl.render(slipped) if coin < 0.5 and changes else p.answer)
    assert texts == expected
    slipped = [t != p.answer for t, p in zip(texts, problems, strict=True)]
    assert 0.35 < np.mean(slipped) < 0.5  # 0.5 x the share where + 1 shows at a hidden input
    rewards = CODE.verify_batch(problems, texts)
    assert rewards == [0.0 if s else 1.0 for s in slipped]
    assert CODE.max_completion_chars(options) == len("abs(x-9)")  # a slip stays in range


def test_every_character_is_in_the_tokenizer_charset():
    rng = np.random.default_rng(12)
    for options in (CodeOptions(), WIDE, CodeOptions(max_ops=1, examples=4, tests=1)):
        noisy = replace(options, error_prob=0.5)
        for p in sample(1000, seed=13, options=options):
            texts = [p.prompt, CODE.teacher_solution(p, rng, options)]
            texts.append(CODE.teacher_solution(p, rng, noisy))
            for text in texts:
                assert set(text) <= set(CHARSET), (text, set(text) - set(CHARSET))


def test_completions_fit_max_completion_chars():
    rng = np.random.default_rng(14)
    for options in (CodeOptions(), WIDE, CodeOptions(max_ops=1)):
        limit = CODE.max_completion_chars(options)
        noisy = replace(options, error_prob=0.9)
        lengths = [len(CODE.teacher_solution(p, rng, noisy)) for p in sample(500, 15, options)]
        assert max(lengths) <= limit
    assert CODE.max_completion_chars(CodeOptions()) == len("abs((x//9)-9)") + 2 == 15


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("max_ops", 3, "1 or 2"),
        ("min_ops", 0, "1..max_ops=2"),
        ("max_const", 1, "2..20"),
        ("examples", 3, "4..10"),
        ("tests", 0, "1..10"),
        ("error_prob", 1.0, r"\[0, 1\)"),
        ("slip", "typo", r"any \| off_by_one"),
    ],
)
def test_options_errors_name_the_field_and_what_is_allowed(field, value, allowed):
    with pytest.raises(
        ConfigError, match=rf"task\.code\.{field}={value!r} is invalid; allowed: {allowed}"
    ):
        CodeOptions(**{field: value})


def test_dataset_problems_have_no_teacher_and_say_so():
    humaneval_like = make_problem(
        "code", "p", "", {"tests": "def check(c):\n    assert c(1) == 2\n", "entry_point": "g"}
    )
    assert not CODE.has_teacher(humaneval_like)
    assert CODE.has_teacher(sample(1, seed=16)[0])
    with pytest.raises(ValueError, match=f"{humaneval_like.problem_id} comes from a dataset"):
        CODE.teacher_solution(humaneval_like, np.random.default_rng(0), CodeOptions())
    assert CODE.verify(humaneval_like, "def g(x):\n    return x + 1\n") == 1.0  # same verifier
