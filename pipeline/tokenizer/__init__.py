"""Tokenizers: the `Tokenizer` protocol every role codes against, and the char tokenizer.

Special ids are fixed by docs/CONVENTIONS.md: PAD=0, BOS=1, EOS=2, UNK=3. A prompt is
encoded as `[BOS] + encode(text)` and a completion as `encode(text) + [EOS]`.

`CharTokenizer` maps each character of a fixed charset (`CHARSET`, everything the
synthetic task families write) to one id after the specials, so
`vocab_size = 4 + len(CHARSET) <= 64` (the default `ModelConfig.vocab_size`). Characters
outside the charset encode to UNK and never raise: model text and adversarial answers
must always round-trip through the pipeline. But a run's own problems must never lose
text that way (an upper-case MATH problem would train on UNKs): `unrepresentable` names
what a tokenizer cannot encode, and the data job refuses such problems
(`pipeline.problem_sets.check_representable`), pointing at `ByteTokenizer` ("byte":
every UTF-8 byte one id, `vocab_size = 4 + 256`), the choice for a run from scratch on
real text. A Hugging Face `tokenizers.Tokenizer` satisfies the same protocol through
`pipeline.tokenizer.hf.HFTokenizer`; a run picks its tokenizer with `model.tokenizer`
("char", "byte", or "hf": the one imported with its base) and every role gets it from
`pipeline.tokenizer.run.run_tokenizer(run)`.

The package is the one place of the run's tokenizer: this module (the protocol, the
built-in tokenizers and their registry; imported by `pipeline.config` to check names),
`hf.py` (the Hugging Face adapter; the `tokenizers` library is imported only when one is
loaded) and `run.py` (the tokenizer of a run, which reads the run's stores).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
NUM_SPECIAL = 4

# Everything the task families write (digits, operators, the answer marker '#',
# separators, lowercase letters, '%' for the code family's modulo, and the backtick and
# newline of a tool call's fences, `pipeline.tool_calls`); one id each, in
# this order, after the specials. New characters go at the end so that the ids of the
# others, and the snapshots trained with them, stay valid.
CHARSET = "0123456789+-*/()=#,;:.<>? abcdefghijklmnopqrstuvwxyz%`\n"

# What `decode` writes for UNK or an id outside the vocabulary (a model whose embedding
# table is wider than the tokenizer can sample one): visible, and never a digit.
REPLACEMENT = "\ufffd"


@runtime_checkable
class Tokenizer(Protocol):
    """What the sampler, trainer, SFT and evaluator need from a tokenizer."""

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, without BOS/EOS. Never raises on unknown characters."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; PAD/BOS/EOS are skipped (decoding does not stop at EOS)."""
        ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_completion(self, text: str) -> list[int]: ...


class TokenizerBase:
    """`encode_prompt`/`encode_completion` in terms of `encode` and the special ids."""

    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_id, *self.encode(text)]

    def encode_completion(self, text: str) -> list[int]:
        return [*self.encode(text), self.eos_id]


class CharTokenizer(TokenizerBase):
    """One id per character of `charset`; unknown characters -> UNK."""

    def __init__(self, charset: str = CHARSET):
        if len(set(charset)) != len(charset):
            raise ValueError(f"charset {charset!r} has repeated characters; each must be unique")
        self.charset = charset
        self._to_id = {c: i + NUM_SPECIAL for i, c in enumerate(charset)}
        self._to_char = dict(enumerate(charset, start=NUM_SPECIAL))
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL + len(self.charset)

    def encode(self, text: str) -> list[int]:
        get = self._to_id.get
        return [get(c, UNK_ID) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in (PAD_ID, BOS_ID, EOS_ID):
                continue
            out.append(self._to_char.get(i, REPLACEMENT))
        return "".join(out)


class ByteTokenizer(TokenizerBase):
    """One id per UTF-8 byte (after the specials): any text round-trips exactly, at the
    cost of several ids for a character outside ASCII; a run from scratch on real data
    (upper case, LaTeX, code) uses it with `model.vocab_size >= 260`."""

    def __init__(self) -> None:
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = PAD_ID, BOS_ID, EOS_ID, None

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL + 256

    def encode(self, text: str) -> list[int]:
        return [b + NUM_SPECIAL for b in text.encode("utf-8", errors="surrogatepass")]

    def decode(self, ids: Sequence[int]) -> str:
        # Ids outside the byte range (UNK, a wider embedding's extra rows) and bytes that
        # are not valid UTF-8 (a sample cut inside a character) both read as REPLACEMENT.
        out, run = [], bytearray()
        for i in ids:
            i = int(i)
            if i in (PAD_ID, BOS_ID, EOS_ID):
                continue
            if NUM_SPECIAL <= i < NUM_SPECIAL + 256:
                run.append(i - NUM_SPECIAL)
                continue
            out.append(run.decode("utf-8", errors="replace") + REPLACEMENT)
            run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def unrepresentable(tok: Tokenizer, texts: Sequence[str]) -> str:
    """The distinct characters of `texts` that `tok` encodes to its UNK id, sorted ("" when
    it has none, or no UNK id at all: byte-level tokenizers)."""
    unk = getattr(tok, "unk_id", None)
    if unk is None:
        return ""
    chars = set().union(*map(set, texts)) if texts else set()
    return "".join(sorted(c for c in chars if unk in tok.encode(c)))


TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {"char": CharTokenizer, "byte": ByteTokenizer}


def get_tokenizer(name: str = "char") -> Tokenizer:
    if name not in TOKENIZERS:
        raise ValueError(f"tokenizer {name!r} is unknown; allowed: {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()
