"""Evaluation-set n-gram index for decontamination (NumPy, no Beam).

A training problem is contaminated when one of its word n-grams (`text.words`: case and
punctuation ignored) is also an n-gram of an evaluation problem. Texts shorter than n
words contribute their whole word sequence as one gram, so a short evaluation problem
copied verbatim is still caught.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from beam_jobs.text import hash64, rolling_hashes, words

_WORD_IDS: dict[str, int] = {}
_MAX_CACHED_WORDS = 1 << 20


def _word_ids(tokens: list[str]) -> list[int]:
    cache = _WORD_IDS
    if len(cache) > _MAX_CACHED_WORDS:
        cache.clear()
    out = []
    for w in tokens:
        h = cache.get(w)
        if h is None:
            h = cache[w] = hash64(w)
        out.append(h)
    return out


def ngram_hashes(text: str, n: int) -> np.ndarray:
    """Sorted unique hashes of the word n-grams of `text`."""
    return np.unique(rolling_hashes(np.array(_word_ids(words(text)), np.uint64), n))


def batch_ngram_hashes(texts: list[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, text index) of the word n-grams of many texts at once (with repeats)."""
    tokens = [words(t) for t in texts]
    lengths = np.array([len(t) for t in tokens], np.int64)
    flat = np.array(_word_ids([w for t in tokens for w in t]), np.uint64)
    if len(flat) == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    owner = np.repeat(np.arange(len(texts)), lengths)
    long_enough = lengths >= n
    parts, part_owner = [], []
    if len(flat) >= n:
        # Windows over the concatenation; keep those lying inside one text.
        h = rolling_hashes(flat, n)
        start_owner = owner[: len(h)]
        end_owner = owner[n - 1 :]
        inside = start_owner == end_owner
        parts.append(h[inside])
        part_owner.append(start_owner[inside])
    ends = np.cumsum(lengths)
    for i in np.flatnonzero(~long_enough & (lengths > 0)):  # short texts: one whole-text gram
        parts.append(rolling_hashes(flat[ends[i] - lengths[i] : ends[i]], n))
        part_owner.append(np.array([i]))
    return np.concatenate(parts), np.concatenate(part_owner)


@dataclass(frozen=True)
class Hit:
    eval_sets: tuple[str, ...]  # every eval set sharing an n-gram with the problem
    eval_problem_id: str  # one evaluation problem it overlaps (first by set, then id)


@dataclass
class NgramIndex:
    """Sorted n-gram hashes of all evaluation problems and who owns each."""

    n: int
    hashes: np.ndarray  # uint64, sorted
    owner: np.ndarray  # int64 index into `owners`, per hash
    owners: list[tuple[str, str]]  # (eval set, eval problem id), sorted

    @classmethod
    def build(cls, n: int, problems: list[tuple[str, str, str]]) -> NgramIndex:
        """From (eval set name, problem id, problem text) triples."""
        owners = sorted({(s, pid) for s, pid, _ in problems})
        rank = {o: i for i, o in enumerate(owners)}
        parts, part_owner = [], []
        for s, pid, text in problems:
            h = ngram_hashes(text, n)
            parts.append(h)
            part_owner.append(np.full(len(h), rank[(s, pid)], np.int64))
        if not parts:
            return cls(n, np.zeros(0, np.uint64), np.zeros(0, np.int64), [])
        hashes, owner = np.concatenate(parts), np.concatenate(part_owner)
        order = np.lexsort((owner, hashes))
        hashes, owner = hashes[order], owner[order]
        # Keep one entry per (hash, eval set): enough to name every set a problem hits.
        set_of = np.array(_set_ranks(owners), np.int64)[owner]
        keep = np.ones(len(hashes), bool)
        keep[1:] = (hashes[1:] != hashes[:-1]) | (set_of[1:] != set_of[:-1])
        return cls(n, hashes[keep], owner[keep], owners)

    def lookup(self, text: str) -> Hit | None:
        return self.lookup_many([text])[0]

    def lookup_many(self, texts: list[str]) -> list[Hit | None]:
        """The hit of each text (None when it shares no n-gram with any eval problem)."""
        hits: list[Hit | None] = [None] * len(texts)
        if len(self.hashes) == 0 or not texts:
            return hits
        grams, owner = batch_ngram_hashes(texts, self.n)
        lo = np.searchsorted(self.hashes, grams, side="left")
        hi = np.searchsorted(self.hashes, grams, side="right")
        found = np.flatnonzero(hi > lo)
        per_text: dict[int, list[int]] = {}
        for g in found.tolist():
            per_text.setdefault(int(owner[g]), []).extend(self.owner[lo[g] : hi[g]].tolist())
        for i, owners in per_text.items():
            sets = tuple(sorted({self.owners[o][0] for o in owners}))
            hits[i] = Hit(sets, self.owners[min(owners)][1])
        return hits

    @property
    def size(self) -> int:
        return len(self.hashes)


def _set_ranks(owners: list[tuple[str, str]]) -> list[int]:
    names = sorted({s for s, _ in owners})
    index = {s: i for i, s in enumerate(names)}
    return [index[s] for s, _ in owners]
