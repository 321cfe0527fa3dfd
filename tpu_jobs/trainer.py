"""The RL trainer: consumes rollout batches in index order, updates, publishes versions.

    python -m tpu_jobs.trainer --run RUN_URL

Load order at start: this run's latest Orbax checkpoint (policy and value-head params,
optimizer state, step, next batch index, counters); else the base model (`base/` snapshot
written by the SFT bootstrap or an HF import). Every start takes a new epoch (fencing
token), so an older trainer still running somewhere can no longer publish. Text is encoded
with the run's tokenizer (`model.tokenizer`). With `mesh.trainer` set, the train state and
batches live on a mesh of all the process's devices (`Learner`, docs/scaling.md); with
`mesh.distributed`, `jax.distributed` starts first (multi-host, see `Trainer`).

Step t reads batch t (so replay is deterministic), drops it if it is more than
`max_staleness` versions old (or holds no group at all, see DAPO below), computes the
loss, updates, publishes version t // publish_every when due and checkpoints every
`checkpoint_every` steps and on SIGTERM. A version a rollout worker reports damaged (and
still needs) is republished with its exact bits from the trainer's parameters, an intact
chain in the store or the checkpoint of its step; where none has them the trainer stops
with exit code 4 and one line (docs/parameter-server.md, *Repairs*).

The objective is `losses.compute_loss` with the LossSpec of `trainer.algorithm` and the
config's overrides (`TrainerConfig.loss_overrides`). `Learner` holds the math (train state,
jitted steps) without any storage, so tests and benchmarks drive it directly.

What pi_old is. Batch t was sampled by pi_behaviour (the worker's version, its log-probs
stored in the batch). With `old_logprobs="recompute"` pi_old is the trainer's policy at
the start of the step, re-evaluated here in float32: on the first (or only) update of a
batch the ratio pi_theta / pi_old is exactly 1 and only later updates of the same batch
(`mini_batches * epochs > 1`) can be clipped. Everything that separates pi_old from
pi_behaviour (staleness <= max_staleness, the sampler's dtype and kernels) goes through
the importance weight pi_old / pi_behaviour of `is_correction` ("tis": truncated at
`is_cap`, "mis": masked above it). With `old_logprobs="behaviour"` the ratio is anchored at
the sampler's log-probs (classic PPO on stored log-probs). Every step logs the alignment
of trainer and sampler (mean / max |log pi_old - log pi_behaviour|) and the IS-ratio
statistics, whichever mode is on.

The loss mask. A batch's optional `loss_mask` (per completion token, 1 = sampled by the
policy) is multiplied into the completion mask (`batching.pack_rows`), never into the
attention mask: masked tokens (a tool episode's observations, a judge row's judged
solution) stay in the sequence and are attended to, but carry no loss, advantage, KL,
entropy, value loss or statistic (pi_old / pi_behaviour alignment, IS ratios, clip
fractions). How each algorithm treats them (token counts, GSPO's sequence ratio, GAE across
an observation) is in `tpu_jobs.learning.losses`; packing (`trainer.pack`) sees the attention mask
only and gives the same numbers (tests/tpu_jobs/test_loss_mask.py).

Learning to judge (`rollout.judge_fraction` > 0, see tpu_jobs/rollout_worker.py): judge
rows carry the judged solution + suffix as completion-side context with a `loss_mask` of 0,
so the completion mask is multiplied by it and only the verdict tokens carry loss,
advantage, KL, entropy and alignment statistics; judge groups are groups like any other
(rewards in {0, 1}, normalised within the group). The completion slots then hold solution
+ suffix + verdict (`judge.judged_completion_len`). Each step logs `solve_reward_mean`
and, when the batch has judge rows, `judge_reward_mean` (the judge's accuracy on the
batch's own solutions).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pipeline import failpoints, weight_codec
from pipeline.batch_checks import BadBatchError, BatchLimits, read_checked
from pipeline.config import ModelConfig, RunConfig
from pipeline.leases import BatchLeases
from pipeline.metrics import tool_use_stats
from pipeline.paramserver import (
    CorruptSnapshotError,
    Snapshot,
    SnapshotNotFoundError,
    StaleEpochError,
)
from pipeline.retention import apply_retention
from pipeline.rollouts import RolloutBatch, required_version
from pipeline.run import CHECKPOINTS_PREFIX, DONE_KEY, Run, RunError, base_server, weights_server
from pipeline.storage import ObjectNotFound, StorageError
from pipeline.tasks.base import REWARD_RANGE
from pipeline.tokenizer import Tokenizer, get_tokenizer
from pipeline.tokenizer.run import run_tokenizer
from tpu_jobs.learning import checkpoints
from tpu_jobs.learning.losses import (
    MAX_LOG_RATIO,
    LossSpec,
    aggregation_norm,
    compute_advantages,
    compute_loss,
    loss_spec,
    masked_max,
    masked_mean,
    masked_min,
)
from tpu_jobs.learning.packing import Packing, pack
from tpu_jobs.learning.value_head import init_value_head, packed_policy_forward, policy_forward
from tpu_jobs.model import mesh as meshlib
from tpu_jobs.model.batching import pack_rows, pad_values, round_up
from tpu_jobs.model.judge import judged_completion_len
from tpu_jobs.model.state import (
    flat_to_params,
    make_optimizer,
    new_model,
    params_to_flat,
    split_model,
)
from tpu_jobs.model.transformer import init_model

sg = jax.lax.stop_gradient


class IntegrityError(RuntimeError):
    """Too many refused batches or non-finite steps in a row, or a weight version the run
    still needs is damaged and no exact copy of it is left: the run cannot go on."""


class StepInputs(NamedTuple):
    """One batch as fixed-shape arrays (rows = prompts_per_batch * G; missing groups of a
    dynamic-sampling batch are all-masked rows that contribute nothing)."""

    tokens: Any  # [R, P + C] int32
    mask: Any  # [R, P + C] int32
    comp_mask: Any  # [R, C] float32
    logp_behaviour: Any  # [R, C] float32, the sampler's log-probs
    rewards: Any  # [R] float32


class Prepared(NamedTuple):
    """Per-batch quantities fixed at the start of a step (general path)."""

    logp_old: Any  # [R, C] the ratio's anchor
    logp_trainer: Any  # [R, C] the trainer's recomputed log-probs at the start
    logp_ref: Any  # [R, C] or None
    old_values: Any  # [R, C] or None
    advantages: Any  # [R, C]
    returns: Any  # [R, C] or None


def alignment_metrics(
    logp_trainer: jax.Array, logp_behaviour: jax.Array, mask: jax.Array, cap: float
) -> dict[str, jax.Array]:
    """Trainer-vs-sampler log-prob agreement and the IS ratio pi_old / pi_behaviour."""
    lr = jnp.where(mask > 0, sg(logp_trainer) - logp_behaviour, 0.0)
    rho = jnp.exp(jnp.clip(lr, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    return {
        "logprob_absdiff_mean": masked_mean(jnp.abs(lr), mask),
        "logprob_absdiff_max": masked_max(jnp.abs(lr), mask),
        "is_ratio_mean": masked_mean(rho, mask),
        "is_ratio_min": masked_min(rho, mask),
        "is_ratio_max": masked_max(rho, mask),
        "is_ratio_frac_over_cap": masked_mean((rho > cap).astype(jnp.float32), mask),
    }


# --------------------------------------------------------------------------------------
# Compiled programs. The model's forward (+ VJP) and backward depend only on the model and
# the shapes; the loss "head" on the objective; the optimizer update on its settings. Each
# is compiled once per process and shared by every Learner with the same key, so trying
# another objective on the same model compiles only a small head program.
# --------------------------------------------------------------------------------------


class ModelPrograms:
    """Jitted model programs for one (model, prompt length, temperature, outputs) key.

    Train params are `{"policy": <model params>[, "value": <value head>]}`; outputs are
    `(logp, entropy | None, values | None)` of the completion tokens, [R, C] each.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        prompt_len: int,
        temperature: float,
        values: bool,
        entropy: bool,
    ) -> None:
        abstract = nnx.eval_shape(lambda: init_model(model_cfg, 0))
        self.fns, _ = split_model(abstract)
        fns, p = self.fns, prompt_len

        # Only the completion's log-probs are taken (`first=p`): the LM head, in chunks of
        # model_cfg.logits_chunk tokens, never runs on the prompt positions. `packing`
        # (`tpu_jobs.learning.packing`, trainer.pack): the same outputs from packed rows.
        def outputs(params, tokens, mask, packing=None):
            if packing is not None:
                out = packed_policy_forward(
                    fns.merge(params["policy"]),
                    packing,
                    mask[:, p:],
                    temperature,
                    params.get("value"),
                    entropy=entropy,
                )
                return out.logp, out.entropy, out.values
            if values or entropy:
                return tuple(
                    policy_forward(
                        fns.merge(params["policy"]),
                        tokens,
                        mask,
                        temperature,
                        params.get("value"),
                        entropy=entropy,
                        first=p,
                    )
                )
            return fns.logprobs(params["policy"], tokens, mask, temperature, first=p), None, None

        def forward_vjp(params, tokens, mask, packing=None):
            return jax.vjp(lambda prm: outputs(prm, tokens, mask, packing), params)

        def ref_logp(ref_params, tokens, mask, packing=None):
            if packing is not None:
                out = packed_policy_forward(
                    fns.merge(ref_params), packing, mask[:, p:], temperature
                )
                return sg(out.logp)
            return sg(fns.logprobs(ref_params, tokens, mask, temperature, first=p))

        # Unjitted, for callers composing their own programs (the fused step).
        self.outputs, self.ref_outputs = outputs, ref_logp
        self.forward = jax.jit(outputs)
        self.forward_vjp = jax.jit(forward_vjp)
        self.backward = jax.jit(lambda vjp_fn, cot: vjp_fn(cot)[0])
        self.ref_logp = jax.jit(ref_logp)


@functools.lru_cache(maxsize=8)
def model_programs(
    model_cfg: ModelConfig, prompt_len: int, temperature: float, values: bool, entropy: bool
) -> ModelPrograms:
    return ModelPrograms(model_cfg, prompt_len, temperature, values, entropy)


def _head_loss(spec: LossSpec, group_size: int, recompute: bool):
    """loss(outs, inp, pre, logp_ref, norm) -> (loss, metrics) for one objective."""

    def loss(outs, inp: StepInputs, pre: Prepared | None, logp_ref, norm):
        logp, entropy, values = outs
        cm = inp.comp_mask
        if pre is None:  # single update: pi_old is the params of this very forward
            logp_trainer = sg(logp)
            logp_old = logp_trainer if recompute else inp.logp_behaviour
            old_values = None if values is None else sg(values)
            extra = {"rewards": inp.rewards, "group_size": group_size}
        else:
            logp_trainer, logp_old, old_values = pre.logp_trainer, pre.logp_old, pre.old_values
            logp_ref = pre.logp_ref
            extra = {"advantages": pre.advantages, "returns": pre.returns}
        value, metrics = compute_loss(
            spec,
            logp,
            logp_old,
            cm,
            logp_ref=logp_ref,
            logp_behaviour=inp.logp_behaviour,
            values=values,
            old_values=old_values,
            entropy=entropy,
            norm=norm,
            **extra,
        )
        metrics = dict(metrics)
        if pre is None:
            metrics.update(alignment_metrics(logp_trainer, inp.logp_behaviour, cm, spec.is_cap))
        return value, metrics

    return loss


@functools.lru_cache(maxsize=64)
def head_programs(spec: LossSpec, group_size: int, recompute: bool):
    """(grad head, prepare head), jitted, for one objective."""
    loss = _head_loss(spec, group_size, recompute)

    def grad_head(outs, inp, pre, logp_ref, norm):
        (value, metrics), cot = jax.value_and_grad(loss, has_aux=True)(
            outs, inp, pre, logp_ref, norm
        )
        metrics["loss"] = value
        return metrics, cot

    def prepare(outs, inp: StepInputs, logp_ref):
        """pi_old, reference, critic values and advantages of the whole batch, once."""
        logp, _, values = outs
        logp_old = logp if recompute else inp.logp_behaviour
        res = compute_advantages(
            spec,
            inp.rewards,
            inp.comp_mask,
            group_size=group_size,
            logp_old=logp_old,
            logp_ref=logp_ref,
            values=values,
        )
        pre = Prepared(logp_old, logp, logp_ref, values, res.advantages, res.returns)
        metrics = dict(res.metrics)
        metrics.update(alignment_metrics(logp, inp.logp_behaviour, inp.comp_mask, spec.is_cap))
        return pre, metrics

    return jax.jit(grad_head), jax.jit(prepare)


@functools.lru_cache(maxsize=32)
def apply_program(
    lr: float,
    warmup_steps: int,
    total_steps: int,
    weight_decay: float,
    grad_clip: float,
    value_lr_mult: float,
):
    """(optimizer, update function, jitted update): AdamW; the value head's updates are
    scaled by value_lr_mult (its learning rate is lr * value_lr_mult).

    The update returns (params, opt_state, grad_norm, finite). The finite-guard: when the
    gradients or the new parameters hold a NaN or an infinity, `finite` is False and the
    params and optimizer state come back unchanged (selected inside the program, so the
    donated buffers need no copy), so one poisoned batch can never reach a published
    version or a checkpoint."""
    tx = make_optimizer(lr, warmup_steps, total_steps, weight_decay, grad_clip)

    def apply(params, opt_state, grads):
        updates, new_opt_state = tx.update(grads, opt_state, params)
        if "value" in updates and value_lr_mult != 1.0:
            scaled = jax.tree.map(lambda u: u * value_lr_mult, updates["value"])
            updates = {**updates, "value": scaled}
        new_params = optax.apply_updates(params, updates)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & all_finite(new_params)
        keep = functools.partial(jnp.where, finite)
        return (
            jax.tree.map(keep, new_params, params),
            jax.tree.map(keep, new_opt_state, opt_state),
            grad_norm,
            finite,
        )

    return tx, apply, jax.jit(apply, donate_argnums=(0, 1))


_add_trees = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool: every floating-point element of `tree` is finite."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.asarray([jnp.isfinite(x).all() for x in leaves]))


def _keep_shardings(apply_fn, state):
    """`apply_fn` whose gradients and new (params, opt_state) are constrained to the
    shardings of `state` = (params, opt_state): each device reduces only its own shard of
    every gradient (a reduce-scatter on GPU and TPU) instead of keeping whole ones."""
    shardings = jax.tree.map(lambda x: x.sharding, state)

    def apply(params, opt_state, grads):
        grads = jax.lax.with_sharding_constraint(grads, shardings[0])
        params, opt_state, grad_norm, finite = apply_fn(params, opt_state, grads)
        params, opt_state = jax.lax.with_sharding_constraint((params, opt_state), shardings)
        return params, opt_state, grad_norm, finite

    return apply


class Learner:
    """The trainer's math for one run config: train state and the update of one step.

    A step chains shared programs: forward (+ VJP) of the model, the objective's head
    (loss, metrics and the cotangents of the model outputs; pi_old = the stop-gradient of
    this forward), the model's backward and the optimizer update. With several updates per
    batch or micro-batches, a no-grad forward first fixes pi_old, the reference and critic
    values and the advantages of the whole batch (`Prepared`). The model programs compile
    once per model and shape and serve every objective (each objective adds a small head
    program). `fused` (default: trainer.fused_step) makes a single-update step one jitted
    program instead; on XLA:CPU that measured slower (benchmarks/results/trainer.md).

    `mesh` (tpu_jobs.model.mesh): the train state is placed by `mesh.PARAM_RULES` (`init_state`,
    `place`) and each step's batch split over data x fsdp, so every micro-batch (the whole
    batch by default) must hold a multiple of data * fsdp rows. The programs are the same
    (GSPMD propagates the shardings). `tokenizer`: the run's (`pipeline.tokenizer.run.run_tokenizer`),
    needed only for judge rows of a model.tokenizer=hf run; default the char tokenizer.
    `abstract`: `template` holds shapes (`jax.ShapeDtypeStruct`s) instead of initialised
    weights, to compile the step for a model too large to allocate here.
    """

    def __init__(
        self,
        cfg: RunConfig,
        prompt_len: int,
        *,
        fused: bool | None = None,
        mesh: jax.sharding.Mesh | None = None,
        tokenizer: Tokenizer | None = None,
        abstract: bool = False,
    ) -> None:
        tc = cfg.trainer
        self.cfg = cfg
        self.mesh = mesh
        self.spec: LossSpec = loss_spec(tc.algorithm, **tc.loss_overrides())
        self.prompt_len = prompt_len
        self.completion_len = cfg.completion_tokens()  # a turn, or a whole tool episode
        if cfg.rollout.judge_groups():  # judge rows: solution + suffix + verdict
            if tokenizer is None and cfg.model.tokenizer != "char":
                raise ValueError(
                    f"model.tokenizer={cfg.model.tokenizer!r} with judge groups: pass the run's "
                    "tokenizer, Learner(..., tokenizer=pipeline.tokenizer.run.run_tokenizer(run))"
                )
            self.completion_len = judged_completion_len(
                cfg.sampler.max_new_tokens, tokenizer or get_tokenizer("char")
            )
        self.group_size = cfg.rollout.group_size
        self.groups = cfg.rollout.prompts_per_batch
        self.rows = self.groups * self.group_size
        if self.groups % tc.mini_batches:
            raise ValueError(
                f"trainer.mini_batches={tc.mini_batches} is invalid for prompts_per_batch="
                f"{self.groups}; allowed: a divisor of prompts_per_batch (mini-batches hold "
                "whole groups)"
            )
        self.mini_rows = self.rows // tc.mini_batches
        self.micro_rows = tc.micro_batch or self.mini_rows
        if self.mini_rows % self.micro_rows:
            raise ValueError(
                f"trainer.micro_batch={tc.micro_batch} is invalid; allowed: 0 or a divisor of "
                f"the mini-batch's {self.mini_rows} rows"
            )
        multiple = 1 if mesh is None else meshlib.batch_size_multiple(mesh)
        if self.micro_rows % multiple:
            raise ValueError(
                f"the trainer mesh {dict(mesh.shape)} splits each (micro-)batch over data x "
                f"fsdp = {multiple} devices, but a (micro-)batch has {self.micro_rows} rows "
                f"(rollout.prompts_per_batch={self.groups} x group_size={self.group_size}, "
                f"trainer.mini_batches={tc.mini_batches}, micro_batch={tc.micro_batch}); "
                f"allowed: a multiple of {multiple} rows (or change mesh.trainer: data * fsdp "
                "must divide it)"
            )
        self.uses_values = self.spec.needs_value_head
        self.needs_ref = self.spec.needs_reference
        self.needs_entropy = self.spec.needs_entropy
        self.recompute = tc.old_logprobs == "recompute"
        self.updates_per_step = tc.mini_batches * tc.epochs
        self.single = self.updates_per_step == 1 and self.micro_rows == self.rows
        self.programs = model_programs(
            cfg.model,
            prompt_len,
            float(cfg.sampler.temperature),
            self.uses_values,
            self.needs_entropy,
        )
        self.fns = self.programs.fns
        self._grad_head, self._prepare = head_programs(self.spec, self.group_size, self.recompute)
        u = self.updates_per_step
        self.tx, apply_fn, self._apply = apply_program(
            tc.lr,
            tc.warmup_steps * u,
            tc.steps * u,
            tc.weight_decay,
            tc.grad_clip,
            tc.value_lr_mult if self.uses_values else 1.0,
        )
        if abstract:  # shapes only, nothing allocated: for compiling (benchmarks/memory.py)
            self.template = jax.eval_shape(lambda: self.init_params(new_model(cfg.model, 0)[1]))
            self.template = self.template, jax.eval_shape(self.tx.init, self.template)
            if mesh is not None:  # the shapes carry the placement `place` would give
                self.template = jax.tree.map(
                    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                    self.template,
                    meshlib.tree_shardings(self.template, mesh),
                )
        else:
            _, policy = new_model(cfg.model, cfg.seed)
            self.template = self.init_state(policy)
        if mesh is not None:
            # Updated state keeps the placement of `place` (XLA would otherwise pick output
            # shardings, e.g. split the norm weights over fsdp, and drift step by step).
            apply_fn = _keep_shardings(apply_fn, self.template)
            self._apply = jax.jit(apply_fn, donate_argnums=(0, 1))
        self.fused = (tc.fused_step if fused is None else fused) and self.single
        if self.fused:
            self._fused_step = jax.jit(
                self._fused_fn(_head_loss(self.spec, self.group_size, self.recompute), apply_fn),
                donate_argnums=(0, 1),
            )

    def _fused_fn(self, loss, apply_fn):
        outputs, ref_outputs = self.programs.outputs, self.programs.ref_outputs

        def step(params, opt_state, ref_params, inp: StepInputs, packing: Packing | None):
            logp_ref = None
            if ref_params is not None:
                logp_ref = ref_outputs(ref_params, inp.tokens, inp.mask, packing)

            def f(prm):
                outs = outputs(prm, inp.tokens, inp.mask, packing)
                return loss(outs, inp, None, logp_ref, None)

            (value, metrics), grads = jax.value_and_grad(f, has_aux=True)(params)
            metrics["loss"] = value
            params, opt_state, metrics["grad_norm"], finite = apply_fn(params, opt_state, grads)
            metrics["nonfinite_updates"] = 1.0 - finite.astype(jnp.float32)
            return params, opt_state, metrics

        return step

    # ------------------------------------------------------------------ state
    def init_params(self, policy_params: Any) -> dict[str, Any]:
        params = {"policy": policy_params}
        if self.uses_values:
            params["value"] = init_value_head(self.cfg.model.hidden_size)
        return params

    def init_state(self, policy_params: Any) -> tuple[dict[str, Any], Any]:
        """(params, optimizer state), placed on the mesh when there is one."""
        params = self.place(self.init_params(policy_params))
        return params, self.place(self.tx.init(params))

    def under_mesh(self) -> contextlib.AbstractContextManager:
        """The context the step's programs are traced and run in: the trainer mesh
        (`jax.set_mesh`), so the model's activation constraints (`tpu_jobs.model.constraints`)
        apply; nothing without a mesh."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def place(self, tree: Any) -> Any:
        """`tree` (params, optimizer state, reference params) on the trainer mesh by
        `mesh.PARAM_RULES`; unchanged without a mesh."""
        return tree if self.mesh is None else meshlib.shard_tree(tree, self.mesh)

    def _place_batch(self, tree: Any) -> Any:
        return tree if self.mesh is None else meshlib.shard_batch(tree, self.mesh)

    # ------------------------------------------------------------------- step
    def _pack(self, inp: StepInputs) -> Packing | None:
        """The rows of `inp` (host arrays) packed when trainer.pack is on, placed like a
        batch; None otherwise."""
        if not self.cfg.trainer.pack:
            return None
        multiple = 1 if self.mesh is None else meshlib.batch_size_multiple(self.mesh)
        packing = pack(np.asarray(inp.tokens), np.asarray(inp.mask), self.completion_len, multiple)
        return self._place_batch(Packing(*(jnp.asarray(x) for x in packing)))

    def _grads(self, params, inp: StepInputs, pre: Prepared | None, logp_ref, norm, packing):
        outs, vjp_fn = self.programs.forward_vjp(params, inp.tokens, inp.mask, packing)
        metrics, cot = self._grad_head(outs, inp, pre, logp_ref, norm)
        return self.programs.backward(vjp_fn, cot), metrics

    def step(self, params, opt_state, ref_params, inp: StepInputs):
        """One trainer step on one batch: (params, opt_state, {metric: float})."""
        with self.under_mesh():
            return self._step(params, opt_state, ref_params, inp)

    def _step(self, params, opt_state, ref_params, inp: StepInputs):
        host = inp  # as given (host arrays from `inputs`): what packing reads
        packing = self._pack(host)  # the whole batch's, for the whole-batch programs
        inp = self._place_batch(StepInputs(*(jnp.asarray(x) for x in inp)))
        logp_ref = None
        if ref_params is not None and self.needs_ref and not self.fused:
            logp_ref = self.programs.ref_logp(ref_params, inp.tokens, inp.mask, packing)
        if self.fused:
            ref = ref_params if self.needs_ref else None
            params, opt_state, metrics = self._fused_step(params, opt_state, ref, inp, packing)
            return params, opt_state, {k: float(v) for k, v in jax.device_get(metrics).items()}
        if self.single:
            grads, metrics = self._grads(params, inp, None, logp_ref, None, packing)
            params, opt_state, metrics["grad_norm"], finite = self._apply(params, opt_state, grads)
            metrics["nonfinite_updates"] = 1.0 - finite.astype(jnp.float32)
            return params, opt_state, {k: float(v) for k, v in jax.device_get(metrics).items()}
        outs = self.programs.forward(params, inp.tokens, inp.mask, packing)
        pre, pre_metrics = self._prepare(outs, inp, logp_ref)
        tc = self.cfg.trainer
        # Each micro-batch is packed once per step (its rows are the same every epoch).
        micro_packings = {}
        if self.cfg.trainer.pack:
            micro_packings = {
                m0: self._pack(StepInputs(*(x[m0 : m0 + self.micro_rows] for x in host)))
                for m0 in range(0, self.rows, self.micro_rows)
            }
        per_update: list[dict[str, Any]] = []
        for _ in range(tc.epochs):
            for k in range(tc.mini_batches):
                lo = k * self.mini_rows
                norm = aggregation_norm(self.spec, inp.comp_mask[lo : lo + self.mini_rows])
                grads, parts = None, []
                for m0 in range(lo, lo + self.mini_rows, self.micro_rows):

                    def take(x, m0=m0):
                        return x[m0 : m0 + self.micro_rows]

                    g, m = self._grads(
                        params,
                        self._place_batch(jax.tree.map(take, inp)),
                        self._place_batch(jax.tree.map(take, pre)),
                        None,
                        norm,
                        micro_packings.get(m0),
                    )
                    grads = g if grads is None else _add_trees(grads, g)
                    parts.append(jax.device_get(m))
                params, opt_state, grad_norm, finite = self._apply(params, opt_state, grads)
                m = {key: float(np.mean([p[key] for p in parts])) for key in parts[0]}
                m["loss"] = float(np.sum([p["loss"] for p in parts]))
                m["grad_norm"] = float(grad_norm)
                m["nonfinite_updates"] = 0.0 if bool(finite) else 1.0
                per_update.append(m)
        metrics = {k: float(v) for k, v in jax.device_get(pre_metrics).items()}
        for key in per_update[0]:
            metrics[key] = float(np.mean([m[key] for m in per_update]))
        # The clip can only act after the first update of a batch: report the last one too.
        for key in ("clip_frac", "ratio_max", "ratio_min", "approx_kl"):
            if key in per_update[-1]:
                metrics[key + "_last_update"] = per_update[-1][key]
        metrics["updates"] = float(len(per_update))
        metrics["nonfinite_updates"] = float(sum(m["nonfinite_updates"] for m in per_update))
        return params, opt_state, metrics

    # ------------------------------------------------------------- batches
    def inputs(self, batch: RolloutBatch, pad_id: int = 0) -> StepInputs:
        """Pack a batch into fixed shapes, padding missing groups with empty rows."""
        n = len(batch)
        if n > self.rows or n % self.group_size:
            raise ValueError(
                f"batch {batch.batch_index} has {n} rows; allowed: whole groups of "
                f"G={self.group_size}, at most prompts_per_batch * G = {self.rows}"
            )
        pad = self.rows - n
        prompts = list(batch.prompt_ids) + [[]] * pad
        completions = list(batch.completion_ids) + [[]] * pad
        # The loss mask (judge rows: the verdict; tool episodes: the sampled turns, not the
        # observations) goes into comp_mask; the attention mask keeps every token.
        loss_masks = None if batch.loss_mask is None else list(batch.loss_mask) + [None] * pad
        tokens, mask, comp_mask = pack_rows(
            prompts, completions, self.prompt_len, self.completion_len, pad_id, loss_masks
        )
        logp_b = pad_values(list(batch.behaviour_logprobs) + [[]] * pad, self.completion_len)
        rewards = np.zeros(self.rows, np.float32)
        rewards[:n] = batch.reward
        return StepInputs(tokens, mask, comp_mask, logp_b, rewards)


@dataclass
class TrainerState:
    params: Any  # {"policy": ..., ["value": ...]}
    opt_state: Any
    step: int = 0
    next_batch: int = 0
    dropped: int = 0  # all dropped batches (stale + empty)
    dropped_stale: int = 0
    dropped_empty: int = 0  # dynamic sampling found no informative group
    staleness_hist: dict[str, int] = field(default_factory=dict)  # over batches read
    quarantined: int = 0  # batches refused (pipeline.batch_checks) or with non-finite steps
    nonfinite_steps: int = 0  # steps the finite-guard skipped
    failures: int = 0  # refused batches and skipped steps since the last good step


class Trainer:
    """`mesh`: the trainer's device mesh; None takes `mesh.trainer` of the run config over
    all devices (None there too: one device).

    Multi-host (`mesh.distributed`, JAX processes > 1): every process runs this same loop
    on the same batches (the steps' collectives keep them in lockstep) and writes its shards
    of the Orbax checkpoints; only process 0 takes the epoch and publishes weights, metrics
    and the done marker."""

    def __init__(
        self,
        run: Run,
        *,
        log=print,
        fused: bool | None = None,
        mesh: jax.sharding.Mesh | None = None,
    ) -> None:
        self.run = run
        self.cfg = run.config
        self.log = log
        self.primary = jax.process_index() == 0
        self.ps = weights_server(run)
        self.leases = BatchLeases(run.store, ttl_seconds=self.cfg.rollout.lease_seconds)
        # The last version this trainer published (its tensors as published): the base of
        # the next delta. None: pull it back from the store when a delta needs it.
        self._published: Snapshot | None = None
        tok = run_tokenizer(run)
        problems = run.read_problems("train")
        prompt_len = round_up(max(len(tok.encode_prompt(p.prompt)) for p in problems), 8)
        self.pad_id = tok.pad_id
        self.mesh = mesh or meshlib.config_meshes(self.cfg.mesh, ("trainer",))["trainer"]
        if self.mesh is not None:
            self.log(f"[trainer] mesh {dict(self.mesh.shape)} of {self.mesh.devices.size} devices")
        self.learner = Learner(self.cfg, prompt_len, fused=fused, mesh=self.mesh, tokenizer=tok)
        self.spec = self.learner.spec
        self.prompt_len = prompt_len
        self.ref_params = None  # the frozen base model, when a KL term needs it
        self._template = self.learner.template
        self.ckpt = checkpoints.TrainerCheckpoints(
            run, keep=self.cfg.trainer.keep_checkpoints, log=log
        )
        self._stop = False
        self.epoch = -1

    # ----------------------------------------------------------- lifecycle
    def restore_or_init(self) -> TrainerState:
        restored = self.ckpt.restore_latest(self._template)
        if restored is not None:
            (params, opt_state), meta = restored
            if meta.get("config_digest") not in self.run.config_digests():
                raise RuntimeError(
                    f"checkpoint at step {meta.get('step')} was written by another config "
                    f"({meta.get('config_digest')} != {self.cfg.digest()}); use a new run"
                )
            self.log(f"[trainer] resumed from checkpoint at step {meta['step']}")
            return TrainerState(
                params,
                opt_state,
                meta["step"],
                meta["next_batch"],
                meta.get("dropped", 0),
                meta.get("dropped_stale", 0),
                meta.get("dropped_empty", 0),
                dict(meta.get("staleness_hist", {})),
                meta.get("quarantined", 0),
                meta.get("nonfinite_steps", 0),
            )
        base = base_server(self.run)
        if base.latest_version() is None:
            raise RunError(_no_start_message(self.run))
        params, opt_state = self.learner.init_state(self._base_params())
        self.log(f"[trainer] starting from the base model ({base.store.url})")
        return TrainerState(params, opt_state)

    def _base_params(self):
        base = base_server(self.run)
        snap = base.pull(base.latest_version())
        params = flat_to_params(self.learner.fns, self._template[0]["policy"], snap.tensors)
        # Own buffers: arrays made from one (cached) snapshot may alias host memory, and the
        # train state is donated to the step while the reference copy must stay alive.
        return self.learner.place(jax.tree.map(lambda x: jnp.array(x, copy=True), params))

    def _publish(self, state: TrainerState, epoch: int) -> None:
        version = state.step // self.cfg.trainer.publish_every
        policy = state.params["policy"]
        if jax.process_count() > 1:  # a collective: every process gathers the global arrays
            policy = meshlib.to_host(policy)
        if not self.primary:
            return
        pc = self.cfg.paramserver
        snap = self._published_snapshot(version, policy)
        base = self._delta_base(version) if pc.full_every > 1 and version > 0 else None
        full = base is None or version % pc.full_every == 0
        try:
            wrote = self.ps.publish_snapshot(
                snap,
                epoch=epoch,
                metadata={"step": state.step},
                base=base,
                full=full,
                full_every=pc.full_every,
            )
            damage = None if wrote else self.ps.damage(version)
        except CorruptSnapshotError as err:  # a committed manifest that is not readable
            wrote, damage = False, str(err)
        if damage is not None:
            # A retry (a resume) found its version committed but damaged: it holds the
            # very tensors, so it republishes them (the same bits) instead of waiting.
            self._repair(snap, damage, "the trainer's parameters")
        # A retry of a committed version leaves its stored bits as the next base (pulled).
        self._published = snap if wrote and pc.full_every > 1 else None
        if wrote:
            kind = "full" if full else "delta"
            self.log(f"[trainer] published v{version} (step {state.step}, {kind})")
        if self.cfg.trainer.keep_versions:
            self._retain(state, epoch)

    def _published_snapshot(self, version: int, policy: Any) -> Snapshot:
        """The policy's tensors in the published dtype (`paramserver.dtype`), as own host
        copies (arrays viewing device buffers would change when the state is donated to the
        next step, and the next delta is taken against these), cut into the pieces of the
        sampler's mesh: cut once, for publish and as the next delta's base."""
        pc = self.cfg.paramserver
        flat = params_to_flat(self.learner.fns, policy)
        cast = weight_codec.cast_for_publish(flat, pc.publish_dtype(self.cfg.sampler.dtype))
        owned = {k: np.array(v, copy=True) if v is flat[k] else v for k, v in cast.items()}
        parts = pc.parts(self.cfg.mesh.sampler)
        split = meshlib.split_axes({k: v.shape for k, v in owned.items()}, parts)
        return Snapshot.of(version, owned, split, parts)

    def _delta_base(self, version: int) -> Snapshot | None:
        """Version - 1 as stored (complete), or None (then a full snapshot is written)."""
        if self._published is not None and self._published.version == version - 1:
            return self._published
        try:
            return self.ps.pull(version - 1)
        except (CorruptSnapshotError, SnapshotNotFoundError) as err:
            self.log(f"[trainer] v{version - 1} unusable as a delta base ({err}); full v{version}")
            return None

    def _retain(self, state: TrainerState, epoch: int) -> None:
        """Delete weight versions no reader needs; StaleEpochError propagates (exit 3)."""
        tc = self.cfg.trainer
        try:
            result = apply_retention(
                self.ps,
                self.leases,
                keep_last=tc.keep_versions,
                next_batch=state.next_batch,
                publish_every=tc.publish_every,
                max_staleness=tc.max_staleness,
                epoch=epoch,
                clock_skew_s=min(30.0, self.cfg.rollout.lease_seconds),
            )
        except StorageError as err:  # housekeeping: the next publish retries it
            self.log(f"[trainer] retention skipped: {err}")
            return
        if result.deleted:
            self.log(f"[trainer] retention deleted v{result.deleted}, kept v{result.kept}")

    @staticmethod
    def _tool_use(batch: RolloutBatch) -> dict[str, Any]:
        """The batch's tool use ({"tools": tool_use_stats}) when it holds tool episodes."""
        if batch.turns is None:
            return {}
        stats = tool_use_stats(batch.turns, batch.tool_calls or [], batch.tool_errors or [])
        return {"tools": stats} if stats else {}

    def _limits(self, state: TrainerState) -> BatchLimits:
        tc, cfg = self.cfg.trainer, self.cfg
        lo, hi = REWARD_RANGE
        if tc.overlong_cache(cfg.completion_tokens()) > 0:
            lo -= 1.0  # DAPO's overlong punishment reaches -1 (losses.overlong_penalty)
        lo -= cfg.environment.reward_floor()  # failed tool calls' penalty
        return BatchLimits(
            index=state.next_batch,
            group_size=cfg.rollout.group_size,
            max_rows=self.learner.rows,
            vocab_size=cfg.model.vocab_size,
            max_prompt_tokens=self.prompt_len,
            max_completion_tokens=self.learner.completion_len,
            policy_version=required_version(state.next_batch, tc.publish_every, tc.max_staleness),
            reward_range=(lo, hi),
            allow_empty=tc.uses_dynamic_sampling(),
        )

    def _heal(self, state: TrainerState) -> None:
        """Act on the rollout workers' damage reports (a version missing or failing
        verification, `ParamServer.report_refused`). A version no pending batch or live
        lease needs any more is let go; one the trainer has not reached yet is repaired when
        it publishes it (`_publish`); any other is republished with its exact bits from the
        first source that has them (`_exact_version`). Raises IntegrityError (exit 4, one
        line) when none has."""
        tc = self.cfg.trainer
        reports = self.ps.refused()
        if not reports:
            return
        current = state.step // tc.publish_every
        oldest = required_version(state.next_batch, tc.publish_every, tc.max_staleness)
        leased = {lease.version for lease in self.leases.live_leases()}
        for version, reasons in sorted(reports.items()):
            if version > current:
                continue  # not reached yet: `_publish` verifies it then
            if version < oldest and version not in leased:
                self.ps.clear_reports(version)
                self.log(f"[trainer] v{version} was reported damaged but is no longer needed")
                continue
            damage = self.ps.damage(version)
            if damage is None:  # repaired meanwhile, or a passing fault of the reader
                self.ps.clear_reports(version)
                continue
            source, snap = self._exact_version(version, state, damage)
            self._repair(snap, f"a rollout worker refused it: {reasons[0]}", source)

    def _exact_version(
        self, version: int, state: TrainerState, damage: str
    ) -> tuple[str, Snapshot]:
        """(where from, the snapshot) of ``version`` with the bits it was published with:
        the trainer's parameters when they are that version's; else any intact chain in
        the store (`ParamServer.derive`); else the checkpoint of its step. IntegrityError,
        naming the version and what to restore, when none has them."""
        tc = self.cfg.trainer
        # The parameters are the version's only at its own step (publish_every > 1).
        if state.step == version * tc.publish_every:
            return "the trainer's parameters", self._published_snapshot(
                version, state.params["policy"]
            )
        derived = self.ps.derive(version)
        if derived is not None:
            return "an intact chain of older versions", self._own_copy(derived)
        step = version * tc.publish_every
        # Only process 0 heals, and a restore is a collective across a multi-host trainer.
        restored = (
            self.ckpt.restore_step(step, self._template)
            if jax.process_count() == 1
            else "a multi-host trainer does not restore single checkpoints to repair"
        )
        if not isinstance(restored, str):
            (params, _), meta = restored
            if meta.get("config_digest") in self.run.config_digests():
                return f"the checkpoint of step {step}", self._published_snapshot(
                    version, params["policy"]
                )
            restored = f"the checkpoint of step {step} was written by another config"
        weights = self.ps.store.url_of(f"weights/v{version:08d}/")
        message = (
            f"weight version v{version} is damaged ({damage}) and no exact copy is left "
            f"({restored}; no intact chain of older versions; the trainer holds "
            f"v{state.step // tc.publish_every}): restore {weights} (or the checkpoint of "
            f"step {step} under {self.run.store.url_of('checkpoints/')}) from a copy and "
            "restart the trainer, or start a new run"
        )
        raise IntegrityError(" ".join(message.split()))  # one line, whatever the reasons hold

    def _own_copy(self, snap: Snapshot) -> Snapshot:
        """A pulled snapshot re-cut as the trainer publishes (own host arrays)."""
        pc = self.cfg.paramserver
        tensors = {k: np.array(v, copy=True) for k, v in snap.tensors.items()}
        parts = pc.parts(self.cfg.mesh.sampler)
        split = meshlib.split_axes({k: v.shape for k, v in tensors.items()}, parts)
        return Snapshot.of(snap.version, tensors, split, parts)

    def _repair(self, snap: Snapshot, why: str, source: str) -> None:
        """Republish ``snap`` (exact bits) over its damaged version (`ParamServer.repair`),
        with a delta against the version before when that one still pulls."""
        version, pc = snap.version, self.cfg.paramserver
        base = None
        if pc.full_every > 1 and version > 0:
            derived = self.ps.derive(version - 1)
            base = None if derived is None else self._own_copy(derived)
        moved = self.ps.repair(
            snap,
            epoch=self.epoch,
            base=base,
            metadata={"step": version * self.cfg.trainer.publish_every, "repaired": why},
            full_every=pc.full_every,
        )
        if self._published is not None and self._published.version == version:
            self._published = snap
        self.log(
            f"[trainer] v{version} was damaged ({why}); republished it from {source} "
            f"(same bits; the damaged objects are in {moved})"
        )

    def _next_batch(self, state: TrainerState) -> tuple[RolloutBatch | str, bytes] | None:
        """(the batch or "empty" for an allowed batch without rows, its bytes), or None when
        asked to stop. A batch that fails `pipeline.batch_checks` is quarantined and waited
        for again (a worker produces it anew)."""
        while True:
            data = self._wait_for_batch(state)
            if data is None:
                return None
            try:
                batch = read_checked(data, self._limits(state))
            except BadBatchError as err:
                self._refuse(state, data, str(err))
                continue
            return ("empty" if batch is None else batch), data

    def _refuse(self, state: TrainerState, data: bytes, reason: str) -> None:
        """Quarantine batch `state.next_batch`; raise IntegrityError after
        `trainer.max_consecutive_failures` failures in a row."""
        index = state.next_batch
        key = self.leases.quarantine(index, data, reason) if self.primary else "(process 0's)"
        state.quarantined += 1
        state.failures += 1
        self.log(
            f"[trainer] refused batch {index}: {reason}; moved to {self.run.store.url_of(key)}, "
            f"a rollout worker produces it again ({state.failures} failure(s) in a row)"
        )
        limit = self.cfg.trainer.max_consecutive_failures
        if state.failures >= limit:
            raise IntegrityError(
                f"{state.failures} refused batches or non-finite steps in a row "
                f"(trainer.max_consecutive_failures={limit}); the last: batch {index}: {reason}. "
                f"The refused batches are under {self.run.store.url_of('quarantine/')}; fix "
                "what writes them (the rollout workers, or whoever else writes to the bucket), "
                "then restart the trainer: it resumes from its newest checkpoint"
            )

    def _wait_for_batch(self, state: TrainerState) -> bytes | None:
        """The committed bytes of batch `state.next_batch`, or None when asked to stop.
        While waiting, refused versions are healed (`_heal`) every few seconds."""
        index, waited, next_heal = state.next_batch, 0.0, 0.0
        while not self._stop:
            if self.primary and waited >= next_heal:
                next_heal = waited + 2.0
                self._heal(state)
            if self.leases.batch_exists(index):
                try:
                    return self.leases.read_batch(index)
                except ObjectNotFound:  # quarantined meanwhile (another trainer's check)
                    continue
            time.sleep(self.cfg.rollout.poll_seconds)
            waited += self.cfg.rollout.poll_seconds
            if waited >= 60 and int(waited) % 60 == 0:
                self.log(
                    f"[trainer] still waiting for batch {index} after {waited:.0f}s; is a "
                    f"rollout worker running? `rlax rollout --run {self.run.url}`"
                )
        return None

    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def _drop(self, state: TrainerState, reason: str, record: dict[str, Any]) -> None:
        state.dropped += 1
        if reason == "stale":
            state.dropped_stale += 1
        else:
            state.dropped_empty += 1
        if self.primary:
            self.run.log_metrics("dropped", state.next_batch, {"reason": reason, **record})
        state.next_batch += 1

    def _dynamic_sampling_stats(self, batch: RolloutBatch) -> dict[str, Any]:
        """Groups kept / dropped by dynamic sampling, from the candidate slots in prompt_pos
        (of the solve groups: dynamic sampling does not act on judge groups)."""
        tc, p = self.cfg.trainer, self.cfg.rollout.solve_groups()
        g = self.cfg.rollout.group_size
        judge = batch.is_judge()
        groups = len(batch) // g
        out: dict[str, Any] = {"groups": groups}
        if self.cfg.rollout.judge_groups():
            out["judge_groups"] = int(judge.sum()) // g
        if not tc.uses_dynamic_sampling():
            return out
        solve = groups - int(judge.sum()) // g
        # Filled: every candidate slot up to the last kept one was seen; else the bound
        # was hit and all rounds * P candidates were seen.
        full = solve == p
        pos = batch.prompt_pos[~judge]
        seen = int(np.max(pos)) + 1 if full and len(pos) else tc.dynamic_sampling_rounds * p
        return {**out, "ds_candidates": seen, "ds_dropped_groups": seen - solve}

    @staticmethod
    def _reward_by_kind(batch: RolloutBatch) -> dict[str, float]:
        """solve_reward_mean, and judge_reward_mean when the batch has judge rows."""
        judge = batch.is_judge()
        out = {}
        if (~judge).any():
            out["solve_reward_mean"] = float(batch.reward[~judge].mean())
        if judge.any():
            out["judge_reward_mean"] = float(batch.reward[judge].mean())
        return out

    def train(self) -> TrainerState:
        tc = self.cfg.trainer
        epoch = self.ps.acquire_epoch() if self.primary else -1  # only process 0 publishes
        self.epoch = epoch
        if self.primary:
            self.log(f"[trainer] epoch {epoch}")
        else:
            self.log(f"[trainer] process {jax.process_index()}: process 0 takes the epoch")
        state = self.restore_or_init()
        if self.learner.needs_ref:
            self.ref_params = self._base_params()
        if state.step % tc.publish_every == 0:
            self._publish(state, epoch)  # v0, or a re-publish a crash may have missed
        while state.step < tc.steps and not self._stop:
            t0 = time.time()
            got = self._next_batch(state)
            if got is None:
                break
            batch, data = got
            t_wait = time.time() - t0
            if isinstance(batch, str):
                self.log(
                    f"[trainer] dropped batch {state.next_batch}: dynamic sampling found no "
                    f"group with unequal rewards"
                )
                self._drop(state, "empty", {})
                continue
            version = state.step // tc.publish_every
            staleness = version - batch.policy_version
            key = str(staleness)
            state.staleness_hist[key] = state.staleness_hist.get(key, 0) + 1
            if staleness > tc.max_staleness:
                self.log(
                    f"[trainer] dropped batch {state.next_batch}: version {batch.policy_version}"
                    f" is {staleness} versions old (max_staleness={tc.max_staleness})"
                )
                self._drop(state, "stale", {"staleness": staleness})
                continue
            inputs = self.learner.inputs(batch, self.pad_id)
            state.params, state.opt_state, metrics = self.learner.step(
                state.params, state.opt_state, self.ref_params, inputs
            )
            if metrics["nonfinite_updates"]:
                # The guard kept the params; the step is not taken, nothing is published or
                # checkpointed, and the batch goes to quarantine like a refused one.
                state.nonfinite_steps += 1
                self._refuse(
                    state,
                    data,
                    f"non-finite gradients or parameters in {metrics['nonfinite_updates']:.0f} "
                    f"update(s) (loss {metrics['loss']}, grad_norm {metrics['grad_norm']})",
                )
                continue
            state.failures = 0
            state.step += 1
            state.next_batch += 1
            record = {
                **metrics,
                **self._dynamic_sampling_stats(batch),
                "step": state.step,
                "batch_index": batch.batch_index,
                "reward_mean": float(batch.reward.mean()),
                **self._reward_by_kind(batch),
                "completion_tokens_mean": batch.num_tokens() / len(batch),
                **self._tool_use(batch),
                "staleness": staleness,
                "staleness_hist": dict(state.staleness_hist),
                "policy_version": batch.policy_version,
                "dropped_total": state.dropped,
                "dropped_stale": state.dropped_stale,
                "dropped_empty": state.dropped_empty,
                "quarantined_total": state.quarantined,
                "nonfinite_steps": state.nonfinite_steps,
                "wait_s": t_wait,
                "step_s": time.time() - t0,
            }
            if self.primary:
                self.run.log_metrics("train", state.step, record)
            self.log(
                f"[trainer] step {state.step}/{tc.steps} reward {record['reward_mean']:.3f} "
                f"loss {metrics['loss']:+.4f} |dlogp| {metrics['logprob_absdiff_mean']:.1e} "
                f"clip {metrics.get('clip_frac', 0.0):.3f} staleness {staleness} "
                f"wait {t_wait:.1f}s step {record['step_s']:.1f}s"
            )
            if state.step % tc.publish_every == 0:
                self._publish(state, epoch)
            if state.step % tc.checkpoint_every == 0 or state.step == tc.steps:
                self.ckpt.save(
                    state.step, (state.params, state.opt_state), self._meta(state, epoch)
                )
                # Tests kill here, while the async write is still in flight.
                failpoints.hit("trainer.checkpoint_started", state.step)
        if self._stop:
            self.log(f"[trainer] stop requested; checkpointing step {state.step}")
            self.ckpt.save(state.step, (state.params, state.opt_state), self._meta(state, epoch))
        self.ckpt.wait()
        if state.step >= tc.steps:
            final = {
                "step": state.step,
                "version": state.step // tc.publish_every,
                "dropped": state.dropped,
                "dropped_stale": state.dropped_stale,
                "dropped_empty": state.dropped_empty,
            }
            if self.primary:
                self.run.store.write_new(DONE_KEY, json.dumps(final).encode())
            self.log(f"[trainer] done: {final}")
        return state

    def _meta(self, state: TrainerState, epoch: int) -> dict[str, Any]:
        return {
            "step": state.step,
            "next_batch": state.next_batch,
            "dropped": state.dropped,
            "dropped_stale": state.dropped_stale,
            "dropped_empty": state.dropped_empty,
            "staleness_hist": dict(state.staleness_hist),
            "quarantined": state.quarantined,
            "nonfinite_steps": state.nonfinite_steps,
            "epoch": epoch,
            "config_digest": self.cfg.digest(),
        }


def _no_start_message(run: Run) -> str:
    return (
        f"run {run.url} has no base model and no checkpoint; run the SFT bootstrap first: "
        f"`rlax sft --run {run.url}` (or `rlax import-hf PATH --run {run.url}`)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_jobs.trainer", description=__doc__)
    parser.add_argument("--run", required=True, help="run URL (directory or gs://bucket/prefix)")
    args = parser.parse_args(argv)
    run = Run.open(args.run)
    # Nothing to start from: say so before an epoch is taken and programs are compiled.
    if base_server(run).latest_version() is None and not run.store.list(f"{CHECKPOINTS_PREFIX}/"):
        raise RunError(_no_start_message(run))
    if run.config.mesh.distributed:  # before any JAX computation
        started = meshlib.initialize_distributed(auto=True)
        print(
            f"[trainer] process {jax.process_index()}/{jax.process_count()} "
            f"({'jax.distributed started' if started else 'single process'}), "
            f"{jax.local_device_count()} of {jax.device_count()} devices local",
            flush=True,
        )
    trainer = Trainer(run, log=lambda m: print(m, flush=True))
    signal.signal(signal.SIGTERM, trainer.request_stop)
    try:
        trainer.train()
    except StaleEpochError as err:
        print(f"[trainer] fenced off by a newer trainer: {err}", file=sys.stderr, flush=True)
        return 3
    except (IntegrityError, checkpoints.CheckpointCorruptError) as err:
        print(f"[trainer] stopped: {err}", file=sys.stderr, flush=True)
        return 4
    return 0


if __name__ == "__main__":
    from pipeline.entrypoint import run_main

    sys.exit(run_main("trainer", main))
