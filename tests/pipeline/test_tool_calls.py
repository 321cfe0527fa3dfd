"""The tool-call text format (pipeline.tool_calls), against hand-written turns."""

import pytest

from pipeline import tool_calls as tc
from pipeline.tokenizer import CharTokenizer


def test_a_closed_call_yields_its_program():
    turn = "let me compute\n```python\nprint(17*23)\n```\n"
    assert tc.call_program(turn) == "print(17*23)\n"
    assert not tc.is_malformed_call(turn)


def test_the_last_opened_fence_is_the_call():
    turn = "```python\nx=1\n```\n```python\nprint(2)\n```\n"
    assert tc.call_program(turn) == "print(2)\n"


@pytest.mark.parametrize("turn", ["#391", "```python\nprint(1)\n", "```python\nprint(1)```"])
def test_a_turn_without_a_closing_fence_calls_nothing(turn):
    assert tc.call_program(turn) is None and not tc.is_malformed_call(turn)


def test_a_close_without_an_open_is_malformed():
    assert tc.call_program("print(1)\n```\n") is None
    assert tc.is_malformed_call("print(1)\n```\n")


def test_observation_is_fenced_newline_terminated_and_truncated():
    assert tc.observation("391", 64) == "```output\n391\n```\n"
    assert tc.observation("", 64) == "```output\n```\n"
    assert tc.observation("x" * 100, 20) == "```output\n" + "x" * 16 + "...\n" + "```\n"
    with pytest.raises(ValueError, match="max_chars"):
        tc.observation("x", 4)


def test_the_char_tokenizer_writes_every_fence_character():
    tok = CharTokenizer()
    for text in (tc.CALL_OPEN, tc.CALL_CLOSE, tc.OUTPUT_OPEN, "print(17*23)\n"):
        assert tok.decode(tok.encode(text)) == text
