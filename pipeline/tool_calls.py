"""The text of a tool-using episode: how a turn calls the Python tool, and how the tool's
output comes back into the sequence.

An episode for `17*23=` that calls the tool once reads (newlines shown as they are):

    prompt        17*23=
    turn 1        ```python
                  print(17*23)
                  ```
    observation   ```output
                  391
                  ```
    turn 2        #391

A turn that calls the tool ends with `CALL_CLOSE` after a `CALL_OPEN` (the engine stops
the turn on `CALL_CLOSE`, `TURN_STOP`); the environment runs the program in between in the
sandbox and appends `observation(...)`, which the policy did not sample (loss mask 0).
Everything here is pure text: the one place that says what a call and an observation look
like, shared by the environment that reads turns, the SFT teacher that writes them and
the report that counts them.
"""

from __future__ import annotations

CALL_OPEN = "```python\n"
CALL_CLOSE = "```\n"
OUTPUT_OPEN = "```output\n"
OUTPUT_CLOSE = "```\n"
# The stop string of a turn: a call's closing fence. The opening fence never contains it
# ("```p..."), so a turn stops only once its program is closed.
TURN_STOP = CALL_CLOSE
TRUNCATED = "...\n"  # appended to output cut at the configured size

# Why a call gave no clean output, one word each (the report counts tool errors by these).
ERROR_KINDS = ("malformed", "error", "timeout", "memory", "output_limit")


def call_program(turn: str) -> str | None:
    """The program a turn calls, or None when the turn does not end in a call.

    A call is the text between the turn's last `CALL_OPEN` and its closing `CALL_CLOSE`,
    which must end the turn. A turn ending in `CALL_CLOSE` with no `CALL_OPEN` before it
    is malformed: `call_program` returns None and `is_malformed_call` says so."""
    if not turn.endswith(CALL_CLOSE):
        return None
    body = turn[: -len(CALL_CLOSE)]
    start = body.rfind(CALL_OPEN)
    if start < 0:
        return None
    return body[start + len(CALL_OPEN) :]


def is_malformed_call(turn: str) -> bool:
    """A turn that closes a fence it never opened."""
    return turn.endswith(CALL_CLOSE) and call_program(turn) is None


def truncate(text: str, max_chars: int) -> str:
    """`text` cut to at most `max_chars` characters, marked with `TRUNCATED` when cut."""
    if max_chars <= len(TRUNCATED):
        raise ValueError(f"max_chars must be > {len(TRUNCATED)}, got {max_chars}")
    if len(text) <= max_chars:
        return text
    return text[: max_chars - len(TRUNCATED)] + TRUNCATED


def observation(body: str, max_chars: int) -> str:
    """The observation appended after a call: `body` (the program's output, or the
    recorded message of a failed call) truncated to `max_chars`, newline-terminated,
    between the output fences."""
    body = truncate(body, max_chars)
    if body and not body.endswith("\n"):
        body += "\n"
    return OUTPUT_OPEN + body + OUTPUT_CLOSE
