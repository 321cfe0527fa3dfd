"""MinHash signatures, LSH banding and duplicate clustering (NumPy, no Beam).

Shingles are character 5-grams of the dedup form of a problem (`text.dedup_text`):
math problems are short, and changing one word of a 40-word problem changes only ~10
of ~200 character 5-grams (Jaccard ~0.9) while word shingles would move it much more.
Signature i of a text is min over its shingles s of `a_i * h(s) + b_i mod 2^64`
(multiply-add hashing of a mixed 64-bit shingle hash), kept as its top 32 bits.
"""

from __future__ import annotations

import functools

import numpy as np

from beam_jobs.text import mix64, rolling_hashes

SHINGLE_CHARS = 5
NUM_PERM = 128
_PERM_SEED = 0x5EED_DED0  # fixed: signatures must not change between runs or versions
_CHUNK_SHINGLES = 4096  # per vector step: (num_perm x 4096) uint64 stays in cache


@functools.lru_cache(maxsize=4)
def _permutations(num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(_PERM_SEED))
    a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) | np.uint64(1)  # odd
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    return a, b


def shingle_hashes(text: str, k: int = SHINGLE_CHARS) -> np.ndarray:
    """Hashes of the character k-grams of `text` (one hash for texts shorter than k)."""
    return _batch_shingles([text], k)[0]


def _batch_shingles(texts: list[str], k: int) -> list[np.ndarray]:
    """`shingle_hashes` of many texts with a handful of vector operations in all."""
    codes = [np.frombuffer(t.encode("utf-32-le", "surrogatepass"), dtype=np.uint32) for t in texts]
    lengths = np.array([len(c) for c in codes], dtype=np.int64)
    flat = np.concatenate(codes).astype(np.uint64) if len(codes) else np.zeros(0, np.uint64)
    count = max(len(flat) - k + 1, 0)
    h = np.zeros(count, np.uint64)
    for j in range(k):  # polynomial hash of each window, then one mixing step
        h = h * np.uint64(0x100000001B3) + flat[j : j + count]
    h = mix64(h)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    out = []
    for i, text_codes in enumerate(codes):
        if lengths[i] >= k:
            out.append(h[starts[i] : ends[i] - k + 1])
        else:
            out.append(rolling_hashes(text_codes, k))
    return out


def signatures(texts: list[str], num_perm: int = NUM_PERM) -> np.ndarray:
    """MinHash signatures, shape (len(texts), num_perm), uint32."""
    a, b = _permutations(num_perm)
    out = np.full((len(texts), num_perm), np.uint32(0xFFFFFFFF), dtype=np.uint32)
    per_text = _batch_shingles(texts, SHINGLE_CHARS)
    start = 0
    while start < len(texts):
        # Whole texts per chunk, about max_shingles shingles in all.
        stop, total = start, 0
        while stop < len(texts) and (
            stop == start or total + len(per_text[stop]) <= _CHUNK_SHINGLES
        ):
            total += len(per_text[stop])
            stop += 1
        lengths = np.array([len(h) for h in per_text[start:stop]])
        nonempty = lengths > 0
        if nonempty.any():
            flat = np.concatenate([h for h in per_text[start:stop] if len(h)])
            values = a[:, None] * flat[None, :]  # (perm, shingle): rows are contiguous
            values += b[:, None]
            offsets = np.concatenate([[0], np.cumsum(lengths[nonempty])[:-1]])
            mins = np.minimum.reduceat(values, offsets, axis=1)
            out[np.arange(start, stop)[nonempty]] = (mins.T >> np.uint64(32)).astype(np.uint32)
        start = stop
    return out


def _false_positive(threshold: float, bands: int, rows: int) -> float:
    s = np.linspace(0.0, threshold, 201)
    return float(np.trapezoid(1 - (1 - s**rows) ** bands, s))


def _false_negative(threshold: float, bands: int, rows: int) -> float:
    s = np.linspace(threshold, 1.0, 201)
    return float(np.trapezoid((1 - s**rows) ** bands, s))


@functools.lru_cache(maxsize=32)
def lsh_params(threshold: float, num_perm: int = NUM_PERM) -> tuple[int, int]:
    """(bands, rows) with bands * rows <= num_perm minimising the false-positive plus
    false-negative area under the LSH S-curve 1 - (1 - s^r)^b around `threshold`."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"near-duplicate threshold {threshold!r} is invalid; allowed: (0, 1)")
    best, best_err = (1, num_perm), float("inf")
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            err = _false_positive(threshold, bands, rows) + _false_negative(threshold, bands, rows)
            if err < best_err - 1e-12:
                best, best_err = (bands, rows), err
    return best


def candidate_probability(jaccard: float, bands: int, rows: int) -> float:
    """Probability that two texts of this Jaccard similarity share at least one band."""
    return 1.0 - (1.0 - jaccard**rows) ** bands


def band_hashes(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One 63-bit key per band, shape (n, bands); the band index is mixed in, so equal
    keys mean equal rows of the same band."""
    n = sigs.shape[0]
    out = np.empty((n, bands), dtype=np.uint64)
    for j in range(bands):
        h = np.full(n, np.uint64(j + 1), np.uint64)
        for col in sigs[:, j * rows : (j + 1) * rows].T:
            h = mix64(h * np.uint64(0x9E3779B97F4A7C15) + col.astype(np.uint64))
        out[:, j] = h >> np.uint64(1)
    return out


def bucket_edges(keys: np.ndarray, uids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows sharing a bucket key are candidates. Returns star edges (min uid of the
    bucket, other uid), so a bucket of m rows gives m - 1 edges, never m^2."""
    if len(keys) == 0:
        empty = np.zeros(0, np.uint64)
        return empty, empty
    order = np.lexsort((uids, keys))
    keys, uids = keys[order], uids[order]
    first = np.ones(len(keys), dtype=bool)
    first[1:] = keys[1:] != keys[:-1]
    group_start = np.maximum.accumulate(np.where(first, np.arange(len(keys)), 0))
    roots = uids[group_start]
    keep = (~first) & (uids != roots)
    return roots[keep], uids[keep]


def components(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Connected components of an undirected edge list of uids.

    Returns (uid, root) for every uid on an edge that is not its component's root; the
    root is the component's smallest uid (so the earliest row survives).
    """
    if len(src) == 0:
        empty = np.zeros(0, np.uint64)
        return empty, empty
    nodes, inverse = np.unique(np.concatenate([src, dst]), return_inverse=True)
    a, b = inverse[: len(src)], inverse[len(src) :]
    label = np.arange(len(nodes))  # nodes are sorted, so the min label is the min uid
    while True:
        m = np.minimum(label[a], label[b])
        new = label.copy()
        np.minimum.at(new, a, m)
        np.minimum.at(new, b, m)
        new = new[new]  # pointer jumping: follow labels to their own labels
        if np.array_equal(new, label):
            break
        label = new
    dropped = label != np.arange(len(nodes))
    return nodes[dropped], nodes[label[dropped]]
