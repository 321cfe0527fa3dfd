"""Token-level self-verification: judged sequences and the model's self-score.

The text format is `pipeline/tasks/judge.py`. A judged row is

    [BOS] prompt | solution EOS | JUDGE_SUFFIX | verdict [EOS]

and the *self-score* of a solution (Self-PRM reranking, the ORM baseline, judge accuracy
in learning-to-judge) is the model's probability of the "yes" verdict at the verdict
position, renormalised over the two verdicts:

    score = p(y) / (p(y) + p(n)) = sigmoid(logit_y - logit_n)   (temperature 1)

API (stable; the evaluator and the rollout worker import it):

    suffix_ids(tok) -> list[int]                       ids of JUDGE_SUFFIX
    verdict_ids(tok) -> (yes_id, no_id)                 ids of VERDICT_YES / VERDICT_NO
    judge_sequences(tok, prompt_ids_list, solution_ids_list) -> (prompts, contexts)
        prompts[i] = prompt_ids_list[i] (a copy), contexts[i] = solution ending in one
        EOS + suffix ids; the verdict is predicted after the last context token.
    verdict_logprobs(model, tok, prompt_ids_list, solution_ids_list, *, batch_size=256)
        -> np.ndarray [N, 2] float32: (log p(y), log p(n)) at the verdict position under
        the full softmax.
    self_scores(model, tok, prompt_ids_list, solution_ids_list, *, batch_size=256)
        -> np.ndarray [N] float32 in [0, 1]: p(y) / (p(y) + p(n)).
    VERDICT_MAX_TOKENS = 2                              a sampled verdict: 1 token + EOS
    judged_completion_len(max_new_tokens, tok) -> int   completion slots of a judge row
        (learning to judge: solution + suffix + verdict in the trainer's completion).

A tool episode is judged as a reader sees it: its completion, observations included, is
the judged solution (the tool's output is evidence for the answer), and the score is read at
the verdict position alone, so no per-token loss mask enters it. In a learning-to-judge row
the whole solution, observations and sampled turns alike, is context with loss mask 0;
only the verdict is trained.

`model` is an nnx `tpu_jobs.model.transformer.Transformer` (e.g. the evaluator's `self.model` after
`load_flat_params`). Rows are scored in chunks of `batch_size`, each packed with
`tpu_jobs.model.batching.pack_rows` (prompt right-aligned, context left-aligned) into widths
and a row count rounded up to the sampler's buckets, and run through ONE jitted forward;
the logits are read at each row's last real position. So a run compiles a bounded number
of shapes, swapping weights never recompiles (the weights are traced, not constants), and
a row's score does not depend on its batch companions (padding is masked out).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipeline.config import ModelConfig, from_dict
from pipeline.run import Run, orm_server
from pipeline.tasks.judge import JUDGE_SUFFIX, VERDICT_NO, VERDICT_YES, judge_context
from pipeline.tokenizer import Tokenizer
from tpu_jobs.model.batching import DEFAULT_BATCH_BUCKETS, DEFAULT_PROMPT_BUCKETS, bucket, pack_rows
from tpu_jobs.model.transformer import (
    Transformer,
    init_model,
    load_flat_params,
    positions_from_mask,
)

__all__ = [
    "load_orm",
    "VERDICT_MAX_TOKENS",
    "judge_sequences",
    "judged_completion_len",
    "self_scores",
    "suffix_ids",
    "verdict_ids",
    "verdict_logprobs",
]


def suffix_ids(tok: Tokenizer) -> list[int]:
    """Token ids of the verification suffix `JUDGE_SUFFIX`."""
    return list(tok.encode(JUDGE_SUFFIX))


def verdict_ids(tok: Tokenizer) -> tuple[int, int]:
    """(yes id, no id): the single token of each verdict character."""
    yes, no = tok.encode(VERDICT_YES), tok.encode(VERDICT_NO)
    if len(yes) != 1 or len(no) != 1:
        raise ValueError(
            f"the verdicts {VERDICT_YES!r}/{VERDICT_NO!r} must be one token each; this "
            f"tokenizer gives {yes} / {no}"
        )
    return int(yes[0]), int(no[0])


# Learning to judge samples this many tokens after the suffix: the verdict, then EOS.
VERDICT_MAX_TOKENS = 2


def judged_completion_len(max_new_tokens: int, tok: Tokenizer) -> int:
    """Completion slots that hold a judge row: a solution of up to `max_new_tokens` tokens
    and its EOS (one more when the sample was cut off without one), the suffix and the
    sampled verdict tokens."""
    return max_new_tokens + 1 + len(suffix_ids(tok)) + VERDICT_MAX_TOKENS


def judge_sequences(
    tok: Tokenizer,
    prompt_ids_list: Sequence[Sequence[int]],
    solution_ids_list: Sequence[Sequence[int]],
) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, contexts) of the judged rows: the prompt unchanged, and the completion-side
    context = solution ids ending in one EOS + the suffix ids (`judge_context`)."""
    if len(prompt_ids_list) != len(solution_ids_list):
        raise ValueError(
            f"{len(prompt_ids_list)} prompts but {len(solution_ids_list)} solutions; "
            "pass one solution per prompt"
        )
    suffix = suffix_ids(tok)
    prompts = [list(p) for p in prompt_ids_list]
    contexts = [judge_context(s, suffix, tok.eos_id) for s in solution_ids_list]
    return prompts, contexts


@functools.partial(jax.jit, static_argnums=(0,))
def _verdict_logprobs(graphdef, state, tokens, mask, last, yes_no):
    model = nnx.merge(graphdef, state)
    hidden, _ = model.hidden(tokens, positions_from_mask(mask), mask)
    # The LM head at the verdict position only: [B, V], never [B, T, V].
    at = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, H]
    logp = jax.nn.log_softmax(model.logits(at), axis=-1)
    return logp[:, yes_no]  # [B, 2]


# The judge's forward holds [rows, heads, width, width] attention scores (no fused
# attention on XLA:CPU): a batch of `batch_size` rows is as wide as this at most, and wider
# rows (a HumanEval prompt is up to 1,505 characters) come fewer to a batch, so that
# rows x width^2 stays within batch_size x SCORE_WIDTH^2. At the demos' widths (<= 256)
# every batch is the full batch_size, as before; 256 rows of 1,536 asked for 31 GB.
SCORE_WIDTH = 256


def judge_batches(
    prompts: Sequence[Sequence[int]],
    contexts: Sequence[Sequence[int]],
    batch_size: int,
    width_buckets: Sequence[int],
) -> list[tuple[int, int]]:
    """Consecutive (start, end) batches of the judged rows: at most `batch_size` rows, and
    rows x (bucketed prompt + context width)^2 <= batch_size x SCORE_WIDTH^2 (one row at
    least)."""
    budget = batch_size * SCORE_WIDTH**2
    out, start, n = [], 0, len(prompts)
    while start < n:
        end, pl, cl = start, 0, 0
        while end < n and end - start < batch_size:
            npl = max(pl, bucket(len(prompts[end]), width_buckets))
            ncl = max(cl, bucket(len(contexts[end]), width_buckets))
            if end > start and (end - start + 1) * (npl + ncl) ** 2 > budget:
                break
            end, pl, cl = end + 1, npl, ncl
        out.append((start, end))
        start = end
    return out


def verdict_logprobs(
    model: Transformer,
    tok: Tokenizer,
    prompt_ids_list: Sequence[Sequence[int]],
    solution_ids_list: Sequence[Sequence[int]],
    *,
    batch_size: int = 256,
    width_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
) -> np.ndarray:
    """[N, 2] float32: (log p(y), log p(n)) at the verdict position of each judged row."""
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size} is invalid; allowed: > 0")
    prompts, contexts = judge_sequences(tok, prompt_ids_list, solution_ids_list)
    n = len(prompts)
    out = np.zeros((n, 2), np.float32)
    if n == 0:
        return out
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must hold at least one token (BOS)")
    graphdef, state = nnx.split(model)
    yes_no = jnp.asarray(verdict_ids(tok), jnp.int32)
    batch_buckets = tuple(b for b in DEFAULT_BATCH_BUCKETS if b < batch_size) + (batch_size,)
    for start, end in judge_batches(prompts, contexts, batch_size, width_buckets):
        ps, cs = prompts[start:end], contexts[start:end]
        rows = len(ps)
        pl = bucket(max(len(p) for p in ps), width_buckets)
        cl = bucket(max(len(c) for c in cs), width_buckets)
        tokens, mask, _ = pack_rows(ps, cs, pl, cl, pad_id=tok.pad_id)
        last = np.asarray([pl + len(c) - 1 for c in cs], np.int32)
        bb = bucket(rows, batch_buckets)
        if bb > rows:  # filler rows: copies of row 0, discarded
            fill = bb - rows
            tokens = np.concatenate([tokens, np.repeat(tokens[:1], fill, 0)])
            mask = np.concatenate([mask, np.repeat(mask[:1], fill, 0)])
            last = np.concatenate([last, np.repeat(last[:1], fill)])
        lp = _verdict_logprobs(graphdef, state, tokens, mask, last, yes_no)
        out[start : start + rows] = np.asarray(jax.device_get(lp))[:rows]
    return out


def self_scores(
    model: Transformer,
    tok: Tokenizer,
    prompt_ids_list: Sequence[Sequence[int]],
    solution_ids_list: Sequence[Sequence[int]],
    *,
    batch_size: int = 256,
    width_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
) -> np.ndarray:
    """[N] float32: p(y) / (p(y) + p(n)) at the verdict position of each judged row."""
    lp = verdict_logprobs(
        model,
        tok,
        prompt_ids_list,
        solution_ids_list,
        batch_size=batch_size,
        width_buckets=width_buckets,
    )
    if len(lp) == 0:
        return np.zeros((0,), np.float32)
    return np.asarray(jax.nn.sigmoid(lp[:, 0] - lp[:, 1]), np.float32)


def load_orm(run: Run) -> tuple[Transformer, dict[str, Any]] | None:
    """(model, snapshot metadata) of the run's published ORM (`tpu_jobs.orm` trains it);
    None if it has none yet."""
    server = orm_server(run)
    if 0 not in server.versions():
        return None
    snap = server.pull(0)
    model = init_model(from_dict(ModelConfig, snap.metadata["model"]), run.config.seed)
    load_flat_params(model, snap.tensors)
    return model, snap.metadata
