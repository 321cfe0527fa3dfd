"""The pinned teacher's log-probs of a rollout's tokens (on-policy distillation).

The rollout worker scores every row it made with the run's teacher (`pipeline.distill`:
pinned and copied under the run on first use) before it commits the batch, so the batch
carries `teacher_logprobs` beside the sampler's `behaviour_logprobs` and the trainer needs
no teacher in memory. The teacher may have another shape than the student (its own
`model` section, from the teacher run's config); it shares the student's tokenizer.

Log-probs are at `sampler.temperature`, the temperature the trainer's log pi is computed
at, so log pi - log pi_teacher compares two distributions at the same temperature. One
forward pass per batch, in float32, on the worker's default device; rows, prompt and
completion widths are padded to the shape buckets of `tpu_jobs.model.batching`, so a run
compiles a handful of programs at most.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from pipeline.run import Run
from pipeline.teacher import TeacherPin, check_copy, pin_teacher, teacher_config
from tpu_jobs.model.batching import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_NEW_TOKEN_BUCKETS,
    DEFAULT_PROMPT_BUCKETS,
    bucket,
    pack_rows,
)
from tpu_jobs.model.transformer import init_model, load_flat_params, sequence_logprobs


class TeacherScorer:
    """The run's pinned teacher, loaded once; `score` gives its log-probs of rows."""

    def __init__(self, run: Run, *, owner: str = "", log=print) -> None:
        self.pin: TeacherPin = pin_teacher(run, owner=owner)
        tensors = check_copy(run, self.pin)
        self.model_cfg = teacher_config(run).model
        model = init_model(self.model_cfg, 0)
        load_flat_params(model, tensors)
        self.graphdef, self.state = nnx.split(model)
        self.temperature = float(run.config.sampler.temperature)
        self.pad_id = 0
        self._programs: dict[int, Any] = {}  # prompt width -> jitted log-probs
        log(f"[teacher] {self.pin.describe()}, {_params(self.state):,} parameters")

    def _program(self, prompt_len: int):
        if prompt_len not in self._programs:
            graphdef, temperature = self.graphdef, self.temperature

            def logprobs(state, tokens, mask):
                model = nnx.merge(graphdef, state)
                return sequence_logprobs(model, tokens, mask, temperature, first=prompt_len)

            self._programs[prompt_len] = jax.jit(logprobs)
        return self._programs[prompt_len]

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        loss_masks: Sequence[Sequence[int] | None] | None = None,
    ) -> list[list[float]]:
        """Per row, the teacher's log-prob of each completion token given the prompt and
        the tokens before it; 0 where the row's loss mask is 0 (context the policy did not
        sample: a tool's observation, a judged solution)."""
        n = len(prompts)
        if n == 0:
            return []
        rows = bucket(n, DEFAULT_BATCH_BUCKETS)
        p = bucket(max(len(x) for x in prompts), DEFAULT_PROMPT_BUCKETS)
        c = bucket(max(1, max(len(x) for x in completions)), DEFAULT_NEW_TOKEN_BUCKETS)
        pad = rows - n
        masks = None if loss_masks is None else [*loss_masks, *([None] * pad)]
        tokens, mask, comp_mask = pack_rows(
            [*prompts, *([[self.pad_id]] * pad)],
            [*completions, *([[]] * pad)],
            p,
            c,
            self.pad_id,
            masks,
        )
        logp = np.asarray(jax.device_get(self._program(p)(self.state, tokens, mask)))
        logp = np.where(comp_mask > 0, logp, 0.0).astype(np.float32)
        return [logp[i, : len(completions[i])].tolist() for i in range(n)]


def _params(state: Any) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(state)))
