"""Sampling shared by every job that samples: the keys and the one
sample -> decode -> verify loop of the rollout worker, the evaluator and the pass-rate job.

Keys. Every sample's PRNG key is `fold_in(seed, stream, index, prompt, sample)`, so a
sample depends on nothing but its coordinates: which worker draws a batch, how batches are
chunked and whether a job was restarted change nothing. Each job has its own `stream` (a
domain separator), so rollouts, evaluation and pass rates never share keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipeline.tasks import get_task
from pipeline.tasks.base import Problem
from tpu_jobs.generate.interface import Sampler, SampleResult, SamplingParams

# Domain separators of the key streams (one per job that samples).
ROLLOUT_STREAM = 0x0A11  # rollout batches
JUDGE_STREAM = 0x0A12  # keys (and solution picks) of learning-to-judge verdicts
EVAL_STREAM = 0xE7A1  # held-out evaluation
PASS_RATE_STREAM = 0x9A55  # pass-rate estimates for curation


def sample_keys(seed: int, stream: int, index: int, group: int, count: int, size: int) -> jax.Array:
    """One key per row of `count` prompts x `size` samples; depends on nothing else."""
    base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), index)
    prompt = jnp.repeat(jnp.arange(count), size) + group
    sample = jnp.tile(jnp.arange(size), count)
    return jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(base, p), s))(prompt, sample)


@dataclass(frozen=True)
class Scored:
    """Completions of some rows, decoded and verified (row order is the caller's)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    logprobs: list[list[float]]
    lengths: np.ndarray  # int32 [rows]
    finished: np.ndarray  # bool [rows]: ended by EOS (not by the token limit)
    rewards: np.ndarray  # float32 [rows]: the task verifier's reward
    verify_s: float = 0.0  # seconds the verifiers ran (on the background thread)
    verify_wait_s: float = 0.0  # seconds the caller waited for them after generating
    # Tool episodes (tpu_jobs.generate.episodes): per row, the loss mask (0 on observation tokens),
    # the turns, the tool calls and the failed calls' ERROR_KINDS; None for single turns.
    loss_masks: list[list[int]] | None = None
    turns: list[int] | None = None
    tool_calls: list[int] | None = None
    tool_errors: list[list[str]] | None = None
    final_texts: list[str] | None = None  # the last turn: what the verifier read
    generate_s: float | None = None  # seconds in the engine (tool episodes)
    tool_s: float | None = None  # seconds the environment's tools ran
    tool_wait_s: float | None = None  # the part of tool_s decoding did not hide
    # Routing replay: per row, the sampler's recorded experts of prompt + completion
    # (`SampleResult.routing`); None when the sampler records none (dense models).
    routing: list[np.ndarray] | None = None


def distinct_rows(problems: Sequence[Problem], texts: Sequence[str]) -> list[int]:
    """For each row, the first row with the same problem object and text (itself if none).
    The object, not its problem_id: a group's rows share one, and two problems that only
    share a prompt (the id hashes the prompt) can never share a verdict."""
    first: dict[tuple[int, str], int] = {}
    pairs = zip(problems, texts, strict=True)
    return [first.setdefault((id(p), t), r) for r, (p, t) in enumerate(pairs)]


def verify_rows(problems: Sequence[Problem], texts: Sequence[str]) -> list[float]:
    """Each row's reward: one `verify_batch` call per task family, so families that run
    a sandbox (math, code) score the whole batch concurrently.

    A (problem, text) pair that repeats is verified once and its reward copied: a reward
    is a function of the problem and the text, and a group of G samples repeats itself
    once the policy sharpens (in the code demo two programs of three were repeats, and
    the sandbox's 256 runs a batch were 45% of its wall time). A program that draws random
    numbers or races its time limit gets one verdict for all its copies, where it used to
    get one per copy."""
    rewards = [0.0] * len(problems)
    source = distinct_rows(problems, texts)
    by_family: dict[str, list[int]] = {}
    for r, p in enumerate(problems):
        if source[r] == r:
            by_family.setdefault(p.task, []).append(r)
    for family, rows in by_family.items():
        scores = get_task(family).verify_batch(
            [problems[r] for r in rows], [texts[r] for r in rows]
        )
        for r, score in zip(rows, scores, strict=True):
            rewards[r] = float(score)
    return [rewards[source[r]] for r in range(len(problems))]


def _timed_verify(problems: Sequence[Problem], texts: Sequence[str]) -> tuple[list[float], float]:
    start = time.perf_counter()
    return verify_rows(problems, texts), time.perf_counter() - start


def decode_rows(
    tok: Any, out: SampleResult
) -> tuple[list[list[int]], list[str], list[list[float]]]:
    """A sampler call's rows as lists: each row's completion ids, text and log-probs."""
    lengths = out.lengths.tolist()
    ids = [out.tokens[r, :n].tolist() for r, n in enumerate(lengths)]
    logps = [out.logprobs[r, :n].tolist() for r, n in enumerate(lengths)]
    return ids, [tok.decode(row) for row in ids], logps


def score(
    tok: Any, problems: Sequence[Problem], prompts: list[list[int]], out: SampleResult
) -> Scored:
    """One sampler call's rows (`out`, row r answering `problems[r]` after `prompts[r]`),
    decoded and verified here (the caller's thread): what `sample_and_verify` returns for
    them."""
    ids, texts, logps = decode_rows(tok, out)
    rewards, seconds = _timed_verify(problems, texts)
    return Scored(
        prompt_ids=prompts,
        completion_ids=ids,
        texts=texts,
        logprobs=logps,
        lengths=np.asarray(out.lengths, np.int32),
        rewards=np.asarray(rewards, np.float32),
        finished=np.asarray(out.finished, bool),
        verify_s=seconds,
        routing=out.routing,
    )


def sample_and_verify(
    sampler: Sampler,
    model: Any,
    tok: Any,
    problems: Sequence[Problem],
    keys: jax.Array,
    params: SamplingParams,
    *,
    batch_size: int | None = None,
    on_batch: Callable[[int, int], None] | None = None,
) -> Scored:
    """Sample one completion per row (`problems[r]` with `keys[r]`, settings `params`), in sampler calls of
    `batch_size` rows (None: one call), decode each and score it with its task's verifier.
    `on_batch(done, total)` is called after each sampler call (progress logs).

    Verification overlaps generation: a chunk's completions are scored on a background
    thread while the sampler generates the next chunk (sandboxed families spend most of
    their time waiting on the sandbox's processes, and XLA releases the GIL)."""
    total = len(problems)
    step = batch_size or max(total, 1)
    prompts = [tok.encode_prompt(p.prompt) for p in problems]
    ids_out: list[list[int]] = []
    texts: list[str] = []
    logps: list[list[float]] = []
    lengths: list[int] = []
    finished: list[bool] = []
    routing: list[np.ndarray] | None = []
    pending: list[Future[tuple[list[float], float]]] = []
    verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")
    try:
        for start in range(0, total, step):
            chunk = problems[start : start + step]
            out = sampler.generate(
                model,
                prompts[start : start + len(chunk)],
                keys[start : start + len(chunk)],
                params,
            )
            chunk_ids, chunk_texts, chunk_logps = decode_rows(tok, out)
            ids_out += chunk_ids
            logps += chunk_logps
            lengths += out.lengths.tolist()
            finished += out.finished.tolist()
            # Every call of one sampler records or none does (a MoE model's static sampler).
            routing = None if out.routing is None or routing is None else routing + out.routing
            texts.extend(chunk_texts)
            pending.append(verifier.submit(_timed_verify, chunk, chunk_texts))
            if on_batch is not None:
                on_batch(start + len(chunk), total)
        waited = time.perf_counter()
        results = [future.result() for future in pending]
        waited = time.perf_counter() - waited
    finally:
        verifier.shutdown(wait=True, cancel_futures=True)
    return Scored(
        prompt_ids=prompts,
        completion_ids=ids_out,
        texts=texts,
        logprobs=logps,
        lengths=np.asarray(lengths, np.int32),
        rewards=np.asarray([s for scores, _ in results for s in scores], np.float32),
        finished=np.asarray(finished, bool),
        verify_s=sum(seconds for _, seconds in results),
        verify_wait_s=waited,
        routing=routing or None,
    )
