"""Text normalisation and stable hashing shared by every curation step.

Pure functions (no Beam): the same text must give the same keys on every worker, in
every process and on every re-run, so nothing here uses Python's salted `hash()`.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

import numpy as np

# Characters NFKC keeps but that only hide differences between copies of a text.
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"), None)
_HSPACE = re.compile(r"[^\S\n]+")  # whitespace except newline
_MANY_NEWLINES = re.compile(r"\n{3,}")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_ALL_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"\w+")

MASK63 = (1 << 63) - 1


# Anything normalize_text would change in an ASCII text.
_ASCII_DIRTY = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]|  | \n|\n |\n\n\n|^\s|\s$")


def normalize_text(text: str) -> str:
    """NFKC, no invisible/control characters, single spaces, at most one blank line."""
    if text.isascii():
        if not _ASCII_DIRTY.search(text):
            return text  # the common case, without the work below
    else:
        text = unicodedata.normalize("NFKC", text).translate(_INVISIBLE)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub(" ", text)
    lines = [_HSPACE.sub(" ", line).strip() for line in text.split("\n")]
    return _MANY_NEWLINES.sub("\n\n", "\n".join(lines)).strip()


def dedup_text(text: str) -> str:
    """The form two problems must share to be exact duplicates: case and spacing ignored."""
    return _ALL_SPACE.sub(" ", text.casefold()).strip()


def hash64(data: str | bytes) -> int:
    """A stable non-negative 63-bit hash (fits int64 columns and numpy uint64)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & MASK63


def words(text: str) -> list[str]:
    """Lower-cased word tokens, punctuation dropped (the usual decontamination form)."""
    return _WORD.findall(text.casefold())


# ------------------------------------------------------------------ vector hashing
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a bijective, well-mixing map of uint64 arrays (array
    arithmetic wraps modulo 2^64 silently)."""
    x = np.asarray(x, dtype=np.uint64).copy()
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


_POWERS = np.cumprod(np.full(64, _GOLDEN, np.uint64), dtype=np.uint64)[::-1].copy()


def rolling_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """Hash of every window of `n` consecutive uint64 tokens (len(tokens) - n + 1 values):
    a polynomial in the tokens (mod 2^64), then mixed.

    Fewer than `n` tokens give one hash of the whole sequence, so short texts still
    have a fingerprint.
    """
    tokens = np.asarray(tokens, dtype=np.uint64)
    if len(tokens) == 0:
        return np.zeros(0, np.uint64)
    n = min(n, len(tokens))
    if n > len(_POWERS):
        raise ValueError(f"n-gram length {n} is invalid; allowed: 1..{len(_POWERS)}")
    windows = np.lib.stride_tricks.sliding_window_view(tokens, n)
    h = (windows * _POWERS[-n:]).sum(axis=1, dtype=np.uint64)
    return mix64(h ^ np.uint64(n))


def word_ids(text: str) -> np.ndarray:
    """Each word of `text` (see `words`) as a stable uint64."""
    return np.array([hash64(w) for w in words(text)], dtype=np.uint64)


def word_ngram_hashes(text: str, n: int) -> np.ndarray:
    """Unique hashes of the word n-grams of `text` (the whole text when shorter than n)."""
    return np.unique(rolling_hashes(word_ids(text), n))
