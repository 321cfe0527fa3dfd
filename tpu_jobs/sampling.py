"""Sampling shared by every job that samples: the keys, the mesh, and the one
sample -> decode -> verify loop of the rollout worker, the evaluator and the pass-rate job.

Keys. Every sample's PRNG key is `fold_in(seed, stream, index, prompt, sample)`, so a
sample depends on nothing but its coordinates: which worker draws a batch, how batches are
chunked and whether a job was restarted change nothing. Each job has its own `stream` (a
domain separator), so rollouts, evaluation and pass rates never share keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipeline.tasks import get_task
from pipeline.tasks.base import Problem
from tpu_jobs import mesh as meshlib

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


def sampler_mesh(cfg: Any, role: str) -> jax.sharding.Mesh | None:
    """The sampler mesh of `mesh.sampler` (None: one device) for a job that uses all the
    devices of its process. Sampling jobs are single-process: each host runs its own."""
    if jax.process_count() > 1:
        raise RuntimeError(
            f"the {role} is a single-process job (it claims its own work), but JAX sees "
            f"{jax.process_count()} processes; run one {role} per host on single-host "
            "machines (mesh.distributed applies to the trainer only)"
        )
    return meshlib.config_meshes(cfg.mesh, ("sampler",))["sampler"]


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


def sample_and_verify(
    sampler: Any,
    model: Any,
    tok: Any,
    problems: Sequence[Problem],
    keys: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    dtype: str = "float32",
    batch_size: int | None = None,
    on_batch: Callable[[int, int], None] | None = None,
) -> Scored:
    """Sample one completion per row (`problems[r]` with `keys[r]`), in sampler calls of
    `batch_size` rows (None: one call), decode each and score it with its task's verifier.
    `on_batch(done, total)` is called after each sampler call (progress logs)."""
    total = len(problems)
    step = batch_size or max(total, 1)
    prompts = [tok.encode_prompt(p.prompt) for p in problems]
    ids_out: list[list[int]] = []
    texts: list[str] = []
    logps: list[list[float]] = []
    lengths: list[int] = []
    rewards: list[float] = []
    finished: list[bool] = []
    for start in range(0, total, step):
        chunk = problems[start : start + step]
        out = sampler.generate(
            model,
            prompts[start : start + len(chunk)],
            keys[start : start + len(chunk)],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            dtype=dtype,
        )
        for r, p in enumerate(chunk):
            n = int(out.lengths[r])
            ids = out.tokens[r, :n].tolist()
            text = tok.decode(ids)
            ids_out.append(ids)
            texts.append(text)
            logps.append(out.logprobs[r, :n].tolist())
            lengths.append(n)
            rewards.append(get_task(p.task).verify(p, text))
            finished.append(bool(out.finished[r]))
        if on_batch is not None:
            on_batch(start + len(chunk), total)
    return Scored(
        prompt_ids=prompts,
        completion_ids=ids_out,
        texts=texts,
        logprobs=logps,
        lengths=np.asarray(lengths, np.int32),
        rewards=np.asarray(rewards, np.float32),
        finished=np.asarray(finished, bool),
    )
