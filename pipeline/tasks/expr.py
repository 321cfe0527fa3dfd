"""A small, safe arithmetic-expression language for countdown answers.

Grammar (recursive descent, left-associative, usual precedence):

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '/') factor)*
    factor := NUMBER | '(' expr ')'

NUMBER is 1..`MAX_NUMBER_DIGITS` ASCII digits; spaces and tabs are skipped; anything else
(unary minus, '**', exponents, names, non-ASCII digits, control or bidi characters) is a
syntax error. Input length and parenthesis depth are bounded before and during parsing,
so a hostile string costs O(len) work at most. Values are exact `fractions.Fraction`s.
Nothing here calls eval/exec/compile or touches Python's own parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

MAX_EXPR_CHARS = 256
MAX_DEPTH = 32
MAX_NUMBER_DIGITS = 9
OPS = "+-*/"
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_DIGITS = frozenset("0123456789")
_SPACE = frozenset(" \t")


class ExprError(ValueError):
    """The text is not a valid expression (or divides by zero when evaluated)."""


@dataclass(frozen=True)
class Num:
    value: int


@dataclass(frozen=True)
class BinOp:
    op: str
    left: Node
    right: Node


Node = Num | BinOp


def tokenize(text: str) -> list[str]:
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError(f"expression has {len(text)} characters; at most {MAX_EXPR_CHARS} allowed")
    tokens: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in _SPACE:
            i += 1
        elif c in _DIGITS:
            j = i
            while j < n and text[j] in _DIGITS:
                j += 1
            if j - i > MAX_NUMBER_DIGITS:
                raise ExprError(f"number at {i} has {j - i} digits; at most {MAX_NUMBER_DIGITS}")
            tokens.append(text[i:j])
            i = j
        elif c in OPS or c in "()":
            tokens.append(c)
            i += 1
        else:
            raise ExprError(f"character {c!r} at {i}; allowed: digits, + - * / ( ) and spaces")
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ExprError("expression ends too early")
        self.pos += 1
        return tok

    def expr(self) -> Node:
        node = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            node = BinOp(op, node, self.term())
        return node

    def term(self) -> Node:
        node = self.factor()
        while self.peek() in ("*", "/"):
            op = self.take()
            node = BinOp(op, node, self.factor())
        return node

    def factor(self) -> Node:
        tok = self.take()
        if tok == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ExprError(f"parentheses nest deeper than {MAX_DEPTH}")
            node = self.expr()
            if self.take() != ")":
                raise ExprError("expected ')'")
            self.depth -= 1
            return node
        if tok[0] in _DIGITS:
            return Num(int(tok))
        raise ExprError(f"expected a number or '(', got {tok!r}")


def parse(text: str) -> Node:
    """Parse `text` into a tree; raises ExprError on anything outside the grammar."""
    tokens = tokenize(text)
    if not tokens:
        raise ExprError("empty expression")
    parser = _Parser(tokens)
    node = parser.expr()
    if parser.peek() is not None:
        raise ExprError(f"unexpected {parser.peek()!r} after a complete expression")
    return node


def apply(op: str, a: Fraction, b: Fraction) -> Fraction:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        raise ExprError("division by zero")
    return a / b


def evaluate(node: Node) -> Fraction:
    """Exact value; raises ExprError on division by zero."""
    if isinstance(node, Num):
        return Fraction(node.value)
    return apply(node.op, evaluate(node.left), evaluate(node.right))


def numbers(node: Node) -> list[int]:
    """The literals used, left to right."""
    if isinstance(node, Num):
        return [node.value]
    return numbers(node.left) + numbers(node.right)


def to_str(node: Node) -> str:
    """Canonical text with the fewest parentheses that keep the tree's value.

    A child needs parentheses when it binds looser than its parent, or when it is the
    right operand of '-' or '/' at the same precedence (a-(b-c), a/(b*c)).
    """
    if isinstance(node, Num):
        return str(node.value)
    prec = _PREC[node.op]
    left, right = to_str(node.left), to_str(node.right)
    if isinstance(node.left, BinOp) and _PREC[node.left.op] < prec:
        left = f"({left})"
    if isinstance(node.right, BinOp):
        rp = _PREC[node.right.op]
        if rp < prec or (rp == prec and node.op in "-/"):
            right = f"({right})"
    return f"{left}{node.op}{right}"


def fmt_value(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


def steps(node: Node) -> list[tuple[Fraction, str, Fraction, Fraction]]:
    """Post-order evaluation steps (left value, op, right value, result)."""
    out: list[tuple[Fraction, str, Fraction, Fraction]] = []

    def walk(n: Node) -> Fraction:
        if isinstance(n, Num):
            return Fraction(n.value)
        a, b = walk(n.left), walk(n.right)
        r = apply(n.op, a, b)
        out.append((a, n.op, b, r))
        return r

    walk(node)
    return out
