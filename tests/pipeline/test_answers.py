"""GSM8K / MATH reference-answer extraction on the tricky cases."""

import pytest

from pipeline.tasks.answers import canonical_number, extract_gsm8k, extract_math


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "7"),
        ("#### 1,234,567", "1234567"),  # thousands separators
        ("#### -1,200", "-1200"),  # negative with separator
        ("#### \u22125", "-5"),  # unicode minus sign
        ("#### 3/4", "3/4"),  # fraction stays a fraction
        ("#### -3 / 4", "-3/4"),
        ("#### $18", "18"),  # currency
        ("####72", "72"),  # no space
        ("#### 0.50", "0.5"),  # trailing zeros
        ("#### 1,000.00", "1000"),
        ("#### 007", "7"),
        ("#### -0", "0"),
        ("#### 5.", "5"),  # sentence full stop
        ("first #### 1\nthen #### 2", "2"),  # the last marker wins
        ("#### 3, 4", "3, 4"),  # a list, not a number: kept as text
        ("#### 12,34", "12,34"),  # malformed grouping: not a number
        ("#### ten", "ten"),
    ],
)
def test_gsm8k_answers(solution, expected):
    assert extract_gsm8k(solution) == expected


@pytest.mark.parametrize("solution", ["The answer is 7.", "#### ", "####\n", ""])
def test_gsm8k_no_answer(solution):
    assert extract_gsm8k(solution) is None


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        (r"So the sum is $\boxed{\frac{3}{4}}$.", r"\frac{3}{4}"),  # nested braces
        (r"$\boxed{-\dfrac{a}{b}}$", r"-\frac{a}{b}"),  # negative, dfrac -> frac
        (r"$\boxed{\frac{\sqrt{2}}{2}}$", r"\frac{\sqrt{2}}{2}"),  # two levels of nesting
        (r"\boxed{10,\!000}", "10000"),  # LaTeX thin space inside a number
        (r"\boxed{1{,}000}", "1000"),
        (r"\boxed{-1,200}", "-1200"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces are not structure
        (r"\boxed{x^{2}} ... finally \boxed{5}", "5"),  # the last box wins
        (r"\boxed 5$", "5"),  # brace-less form
        (r"\fbox{3}", "3"),
        (r"\boxed{ 2.50 }", "2.5"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"( 3, \frac{\pi}{2} )"),
        (r"\boxed{\text{(C)}}", r"\text{(C)}"),
    ],
)
def test_math_answers(solution, expected):
    assert extract_math(solution) == expected


@pytest.mark.parametrize(
    "solution",
    [r"no box here", r"\boxed{\frac{1}{2}", r"\boxed{}", r"\boxedx{3}", r"\boxed{\}"],
)
def test_math_no_answer(solution):
    assert extract_math(solution) is None


def test_canonical_number_rejects_text():
    assert canonical_number("x+1") is None
    assert canonical_number("1e5") is None
    assert canonical_number("+7") == "7"
