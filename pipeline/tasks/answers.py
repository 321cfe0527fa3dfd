"""Reference-answer extraction for GSM8K (`#### <number>`) and MATH (`\\boxed{...}`).

Both return the canonical answer string, or None when no answer can be extracted.
Numbers are canonicalised the same way for both sources: thousands separators and a
leading `$` removed, unicode minus signs mapped to `-`, trailing zeros of decimals
dropped ("2.50" -> "2.5", "3.0" -> "3"); fractions stay fractions ("-3/4").
"""

from __future__ import annotations

import re

_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-", "\u2014": "-"})
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DECIMAL = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")
_FRACTION = re.compile(r"([+-]?)\s*(\d+)\s*/\s*(\d+)")


def canonical_number(text: str) -> str | None:
    """ "1,234.50" -> "1234.5", "-0" -> "0", "3 / 4" -> "3/4"; None if not a plain number."""
    s = text.strip().translate(_MINUS)
    s = s.removeprefix("$").strip().rstrip(".").strip()
    if s.startswith("-$") or s.startswith("+$"):
        s = s[0] + s[2:]
    if "," in s:
        # Only well-formed groups of three ("1,000,000"); "3,4" is a list, not a number.
        if not re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?", s):
            return None
        s = _THOUSANDS.sub("", s)
    if _DECIMAL.fullmatch(s):
        sign = "-" if s.startswith("-") else ""
        digits = s.lstrip("+-")
        whole, _, frac = digits.partition(".")
        whole = whole.lstrip("0") or "0"
        frac = frac.rstrip("0")
        value = whole + ("." + frac if frac else "")
        return "0" if value == "0" else sign + value
    m = _FRACTION.fullmatch(s)
    if m:
        sign = "-" if m.group(1) == "-" else ""
        return f"{sign}{int(m.group(2))}/{int(m.group(3))}"
    return None


def extract_gsm8k(answer: str) -> str | None:
    """The text after the last `####`, canonicalised when it is a number."""
    if "####" not in answer:
        return None
    final = answer.rsplit("####", 1)[1].strip()
    if not final:
        return None
    final = final.splitlines()[0].strip()
    return canonical_number(final) or final


_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _balanced(text: str, start: int) -> int | None:
    """Index just past the `}` closing the `{` at text[start]; escaped braces don't count."""
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (\{, \}, \\)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


_LATEX_CLEANUP = (
    (re.compile(r"\\[dt]frac(?![A-Za-z])"), r"\\frac"),
    (re.compile(r"\\(left|right)(?![A-Za-z])"), ""),
    (re.compile(r"\\[!,;: ]"), ""),  # spacing commands: "10,\!000" -> "10,000"
    (re.compile(r"\{,\}"), ","),  # "1{,}000" -> "1,000"
    (re.compile(r"\s+"), " "),
)


def clean_latex(answer: str) -> str:
    for pattern, repl in _LATEX_CLEANUP:
        answer = pattern.sub(repl, answer)
    return answer.strip().strip("$").strip()


def last_boxed(solution: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`), braces balanced."""
    matches = list(_BOXED.finditer(solution))
    if not matches:
        return None
    end = matches[-1].end()
    rest = solution[end:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        start = end + (len(rest) - len(stripped))
        close = _balanced(solution, start)
        if close is None:
            return None
        return solution[start + 1 : close - 1]
    m = re.match(r"\s+([^\s$]+)", rest)  # "\boxed 5" form
    return m.group(1) if m else None


def extract_math(solution: str) -> str | None:
    """Cleaned content of the last `\\boxed{}`; None when absent, empty or unbalanced."""
    boxed = last_boxed(solution)
    if boxed is None:
        return None
    answer = clean_latex(boxed)
    if not answer:
        return None
    return canonical_number(answer) or answer
