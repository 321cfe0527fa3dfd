"""Packing prompts and completions into the fixed-shape rows the jitted steps expect.

Row layout (docs/CONVENTIONS.md): the prompt right-aligned in `prompt_len` slots
(left padding), then the completion left-aligned in `completion_len` slots, so every
completion token sits at a fixed offset and one compiled step fits every batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Shape buckets of the jitted programs (the samplers, the judge's scoring): a size is padded
# up to its bucket, so each bucket compiles once.
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512)
DEFAULT_NEW_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512)


def bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; beyond the largest, the next multiple of the largest."""
    for b in sorted(buckets):
        if b >= n:
            return b
    top = max(buckets)
    return -(-n // top) * top


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def pack_rows(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    prompt_len: int,
    completion_len: int,
    pad_id: int = 0,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (tokens [B, P+C] int32, mask [B, P+C] int32, completion_mask [B, C] float32).

    `mask` is the attention mask: every real token, prompt and completion. `loss_masks`
    (one per row, None for all ones) holds 1 on the completion tokens the policy sampled
    and 0 on context inside the completion (a tool's observation, a judged solution); it is
    multiplied into `completion_mask`, so those tokens are attended to but carry no loss.
    """
    b = len(prompts)
    if loss_masks is not None and len(loss_masks) != b:
        raise ValueError(f"{len(loss_masks)} loss masks for {b} rows; pass one per row (or None)")
    tokens = np.full((b, prompt_len + completion_len), pad_id, np.int32)
    mask = np.zeros_like(tokens)
    comp_mask = np.zeros((b, completion_len), np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if len(p) > prompt_len or len(c) > completion_len:
            raise ValueError(
                f"row {i}: prompt {len(p)} / completion {len(c)} tokens exceed the packed "
                f"shape {prompt_len} / {completion_len}; raise sampler.max_new_tokens or "
                "shorten the task"
            )
        tokens[i, prompt_len - len(p) : prompt_len] = p
        mask[i, prompt_len - len(p) : prompt_len] = 1
        tokens[i, prompt_len : prompt_len + len(c)] = c
        mask[i, prompt_len : prompt_len + len(c)] = 1
        lm = None if loss_masks is None else loss_masks[i]
        if lm is None:
            comp_mask[i, : len(c)] = 1.0
        elif len(lm) != len(c):
            raise ValueError(
                f"row {i}: loss mask of {len(lm)} entries for {len(c)} completion tokens; "
                "they must match"
            )
        else:
            comp_mask[i, : len(c)] = lm
    return tokens, mask, comp_mask


def pack_routing(
    routing: Sequence[np.ndarray | None],
    prompt_lens: Sequence[int],
    prompt_len: int,
    completion_len: int,
    shape: tuple[int, int],
    num_experts: int,
) -> np.ndarray:
    """Recorded routing laid out like `pack_rows`' tokens: [B, P+C, layers, k] int32.

    `routing[i]`: row i's record (`pipeline.rollouts`: [prompt + completion tokens,
    layers, k] flattened; None: not recorded), `prompt_lens[i]` its prompt's tokens,
    `shape` (layers, k). Pads and unrecorded tokens hold the mark E (`num_experts`): the
    trainer's routers choose there."""
    out = np.full((len(routing), prompt_len + completion_len, *shape), num_experts, np.int32)
    for i, (r, p) in enumerate(zip(routing, prompt_lens, strict=True)):
        if r is None:
            continue
        rows = np.asarray(r).reshape(-1, *shape)
        out[i, prompt_len - p : prompt_len - p + len(rows)] = rows
    return out


def pad_values(rows: Sequence[Sequence[float]], length: int) -> np.ndarray:
    out = np.zeros((len(rows), length), np.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
