"""The code family's generator: write a one-line Python function from input/output examples.

A program of the DSL is a chain of one to `max_ops` unary integer operations applied to
x in order, each with a small constant c:

    add x+c   sub x-c   mul x*c   div x//c   mod x%c   max max(x,c)   min min(x,c)
    absdiff abs(x-c)

rendered as one Python expression (an infix inner operation is parenthesised when the
outer one is infix too, always, so the form does not depend on precedence):

    prompt      f(0)=-2;f(1)=0;f(2)=2;f(7)=12;f(13)=24;f(22)=42; def f(x): return
    completion  (x*2)-2

The prompt shows f at 0, 1, 2 and at `examples - 3` other inputs (ascending) and ends with
the function's header, so the completion is the body that continues it (HumanEval's
shape: `meta["prefix"]` is the header, and `pipeline.tasks.code_task` puts it in front of
a completion that does not define `f`). The hidden tests (`meta["tests"]`, HumanEval's
`check(candidate)` form) evaluate f at `tests` other inputs, never shown; every input lies
in 0..DOMAIN-1. Every character of a prompt and of a teacher's completion is in the char
tokenizer's CHARSET. No string operations: the charset has no quote character.

Why this shape. The 0.6M-parameter demo model has no scratchpad here (the completion is
the program), so the examples always start with f(0), f(1), f(2): most operations then
show their constant there (add: c, c+1, c+2; mul: 0, c, 2c; max: c, c, c; absdiff: c,
c-1, c-2) and the other inputs, drawn at random, tell div, mod and min apart and make
prompts varied enough for 20000 distinct training problems. A problem is kept only if the
examples determine the hidden outputs by Occam's rule (`identified`): every DSL program
of at most as many operations that fits the examples agrees at the hidden inputs, and no
shorter one fits. Inputs are never negative, so programs that differ only below 0
(max(x+3,1) and x+3) count as the same.

Teacher mistake: each operation, with probability `error_prob`, is replaced by a slip of
the kind `slip` names (`SLIPS`), drawn among the slips that change f on the hidden inputs,
so a slipped one-operation program always fails its tests:
- `any` (the default): a plausible slip, its constant off by one either way or a
  neighbouring operator (add<->sub, mul->add, div<->mod, max<->min, absdiff->sub);
- `off_by_one`: programming's classic bug, and one systematic habit: the constant one
  too large (one too small where that would leave the DSL's range). What the model copies
  from this teacher is one decision, exact or +1, that RL can correct across every
  problem at once (the arithmetic teacher's dropped carry plays the same part), where
  `any` spreads the teacher's mass over three or four wrong programs per operation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.errors import check

ENTRY_POINT = "f"
HEADER = f"def {ENTRY_POINT}(x): return "
DOMAIN = 30  # every shown and hidden input lies in 0..DOMAIN-1
ANCHORS = 3  # the examples always show f(0), f(1), f(2)
MAX_TRIES = 10_000  # rejection sampling of identified problems


@dataclass(frozen=True)
class Op:
    """One DSL operation: its Python template ({x}: the inner expression, {c}: the
    constant), its value on an integer array (NumPy's // and % floor like Python's), the
    smallest constant that is not trivial, and whether it is an infix operator."""

    template: str
    apply: Callable[[np.ndarray, int], np.ndarray]
    min_const: int
    infix: bool


OPS: dict[str, Op] = {
    "add": Op("{x}+{c}", lambda x, c: x + c, 1, True),
    "sub": Op("{x}-{c}", lambda x, c: x - c, 1, True),
    "mul": Op("{x}*{c}", lambda x, c: x * c, 2, True),
    "div": Op("{x}//{c}", lambda x, c: x // c, 2, True),
    "mod": Op("{x}%{c}", lambda x, c: x % c, 2, True),
    "max": Op("max({x},{c})", lambda x, c: np.maximum(x, c), 1, False),
    "min": Op("min({x},{c})", lambda x, c: np.minimum(x, c), 1, False),
    "absdiff": Op("abs({x}-{c})", lambda x, c: np.abs(x - c), 1, False),
}
# The teacher's operator slips (a constant off by one is always a candidate too).
SWAPS: dict[str, tuple[str, ...]] = {
    "add": ("sub",),
    "sub": ("add",),
    "mul": ("add",),
    "div": ("mod",),
    "mod": ("div",),
    "max": ("min",),
    "min": ("max",),
    "absdiff": ("sub",),
}
# Inner expressions sit next to an operator in these outer templates: parenthesise an
# infix inner there (absdiff's {x} is followed by '-').
_WRAPS_INFIX = frozenset(name for name, op in OPS.items() if op.infix) | {"absdiff"}

Program = tuple[tuple[str, int], ...]  # ((op name, constant), ...), applied in order


@dataclass(frozen=True)
class CodeOptions:
    """`task.code.*`: the synthetic code problems (pipeline/tasks/code_dsl.py) and how
    often the teacher slips on an operation."""

    min_ops: int = 1
    max_ops: int = 2
    max_const: int = 9
    examples: int = 6  # shown: f(0), f(1), f(2) and examples - 3 other inputs
    tests: int = 6  # hidden test inputs
    error_prob: float = 0.3  # the teacher slips on each operation this often
    slip: str = "any"  # which slips (SLIPS): any | off_by_one

    def __post_init__(self) -> None:
        check(1 <= self.max_ops <= 2, "task.code.max_ops", self.max_ops, "1 or 2")
        check(
            1 <= self.min_ops <= self.max_ops,
            "task.code.min_ops",
            self.min_ops,
            f"1..max_ops={self.max_ops}",
        )
        check(2 <= self.max_const <= 20, "task.code.max_const", self.max_const, "2..20")
        check(
            ANCHORS < self.examples <= 10, "task.code.examples", self.examples, f"{ANCHORS + 1}..10"
        )
        check(1 <= self.tests <= 10, "task.code.tests", self.tests, "1..10")
        check(0 <= self.error_prob < 1, "task.code.error_prob", self.error_prob, "[0, 1)")
        check(self.slip in SLIPS, "task.code.slip", self.slip, " | ".join(SLIPS))


# ------------------------------------------------------------------ programs


def render(program: Program) -> str:
    """The program's Python expression in x (the body after `HEADER`)."""
    text, inner_infix = "x", False
    for name, c in program:
        op = OPS[name]
        inner = f"({text})" if inner_infix and name in _WRAPS_INFIX else text
        text, inner_infix = op.template.format(x=inner, c=c), op.infix
    return text


def evaluate(program: Program, xs: np.ndarray) -> np.ndarray:
    """f at the integer inputs `xs` (int64), computed by the DSL's own semantics."""
    out = np.asarray(xs, dtype=np.int64)
    for name, c in program:
        out = OPS[name].apply(out, c)
    return out


def constants(name: str, max_const: int) -> range:
    return range(OPS[name].min_const, max_const + 1)


def single_ops(max_const: int) -> list[tuple[str, int]]:
    return [(name, c) for name in OPS for c in constants(name, max_const)]


@functools.cache
def _table(max_ops: int, max_const: int) -> tuple[list[Program], np.ndarray, np.ndarray]:
    """Every program of 1..max_ops operations (fewest first), its values on
    0..DOMAIN-1 (one row each) and its operation count: what `identified` compares a
    problem against."""
    xs = np.arange(DOMAIN, dtype=np.int64)
    ops = single_ops(max_const)
    level_programs: list[Program] = [(o,) for o in ops]
    level_rows = np.stack([evaluate(p, xs) for p in level_programs])
    programs, rows = list(level_programs), [level_rows]
    for _ in range(max_ops - 1):
        nxt_programs, nxt_rows = [], []
        for name, c in ops:  # one vectorised step over the whole previous level
            nxt_rows.append(OPS[name].apply(level_rows, c))
            nxt_programs += [(*p, (name, c)) for p in level_programs]
        level_programs, level_rows = nxt_programs, np.concatenate(nxt_rows)
        programs += level_programs
        rows.append(level_rows)
    sizes = np.asarray([len(p) for p in programs])
    return programs, np.concatenate(rows), sizes


def identified(
    program: Program, shown: Sequence[int], hidden: Sequence[int], options: CodeOptions
) -> bool:
    """Whether the examples (f at `shown`) determine f at `hidden` by Occam's rule:
    every DSL program of at most len(program) operations that matches the examples also
    matches at `hidden`, and none with fewer operations matches them (the canonical
    program is a shortest one, and "the simplest program that fits" is the answer)."""
    _, table, sizes = _table(options.max_ops, options.max_const)
    shown, hidden = list(shown), list(hidden)
    want = evaluate(program, np.arange(DOMAIN))
    agree = (sizes <= len(program)) & np.all(table[:, shown] == want[shown], axis=1)
    if np.any(agree & (sizes < len(program))):
        return False
    return bool(np.all(table[agree][:, hidden] == want[hidden]))


def max_render_chars(options: CodeOptions) -> int:
    """The longest program text of the options' DSL (slips stay inside it)."""
    programs, _, _ = _table(options.max_ops, options.max_const)
    return max(len(render(p)) for p in programs)


# ------------------------------------------------------------------ problems


def prompt_text(program: Program, shown: Sequence[int]) -> str:
    values = evaluate(program, np.asarray(shown))
    pairs = ";".join(f"{ENTRY_POINT}({x})={int(y)}" for x, y in zip(shown, values, strict=True))
    return f"{pairs}; {HEADER}"


def tests_text(program: Program, hidden: Sequence[int]) -> str:
    """HumanEval-style hidden tests: `check(candidate)` raises on the first wrong value."""
    values = evaluate(program, np.asarray(hidden))
    lines = [
        f"    assert candidate({x}) == {int(y)}, {x}" for x, y in zip(hidden, values, strict=True)
    ]
    return "def check(candidate):\n" + "\n".join(lines) + "\n"


def sample_program(rng: np.random.Generator, options: CodeOptions) -> Program:
    """Operation count uniform in min_ops..max_ops, operations and constants uniform."""
    n = int(rng.integers(options.min_ops, options.max_ops + 1))
    names = list(OPS)
    out = []
    for _ in range(n):
        name = names[int(rng.integers(len(names)))]
        c = constants(name, options.max_const)
        out.append((name, int(c[int(rng.integers(len(c)))])))
    return tuple(out)


def sample(rng: np.random.Generator, options: CodeOptions) -> tuple[Program, list[int], list[int]]:
    """A program, its shown inputs (0..ANCHORS-1 and examples - ANCHORS others, ascending)
    and its hidden inputs (never shown), drawn until the examples identify it."""
    others = options.examples - ANCHORS
    for _ in range(MAX_TRIES):
        program = sample_program(rng, options)
        rest = rng.permutation(np.arange(ANCHORS, DOMAIN))[: others + options.tests]
        shown = list(range(ANCHORS)) + sorted(int(x) for x in rest[:others])
        hidden = sorted(int(x) for x in rest[others:])
        if identified(program, shown, hidden, options):
            return program, shown, hidden
    raise RuntimeError(f"no identified code problem found in {MAX_TRIES} tries ({options})")


# ------------------------------------------------------------------ the teacher


def _any_slip(name: str, c: int, max_const: int) -> list[tuple[str, int]]:
    """Constant +-1, neighbour operators."""
    candidates = [(name, c + d) for d in (-1, 1) if c + d in constants(name, max_const)]
    return candidates + [(s, c) for s in SWAPS[name] if c in constants(s, max_const)]


def _off_by_one(name: str, c: int, max_const: int) -> list[tuple[str, int]]:
    """The constant + 1, or - 1 at the top of its range."""
    return [(name, c + 1 if c + 1 in constants(name, max_const) else c - 1)]


# `task.code.slip`: the wrong versions of one operation (name, constant) a teacher draws from.
SLIPS: dict[str, Callable[[str, int, int], list[tuple[str, int]]]] = {
    "any": _any_slip,
    "off_by_one": _off_by_one,
}


def slips(program: Program, at: int, options: CodeOptions) -> list[Program]:
    """The wrong versions of operation `at` that the teacher of `options` (its `slip`
    kind, within its `max_const`) may write."""
    name, c = program[at]
    candidates = SLIPS[options.slip](name, c, options.max_const)
    return [(*program[:at], slip, *program[at + 1 :]) for slip in candidates]


def teacher_program(
    program: Program, hidden: Sequence[int], rng: np.random.Generator, options: CodeOptions
) -> Program:
    """The teacher's program: each operation slips with probability `error_prob`, to a
    slip that leaves f wrong at `hidden` (none when no slip does), so a teacher program
    that slipped always fails its tests. Draws 2 numbers per
    operation whatever happens, so later draws do not depend on earlier slips."""
    coins = rng.random(len(program))
    picks = rng.random(len(program))
    xs = np.asarray(hidden)
    want = evaluate(program, xs)
    out = program
    for at in range(len(program)):
        if coins[at] >= options.error_prob:
            continue
        # Against the true f, not the program so far: a second slip never undoes a first.
        wrong = [s for s in slips(out, at, options) if np.any(evaluate(s, xs) != want)]
        if wrong:
            out = wrong[min(int(picks[at] * len(wrong)), len(wrong) - 1)]
    return out


def parse_program(meta_program: Sequence[Sequence[object]]) -> Program:
    """A program from its JSON form in a problem's meta ([[name, c], ...])."""
    return tuple((str(name), int(c)) for name, c in meta_program)  # type: ignore[call-overload]
