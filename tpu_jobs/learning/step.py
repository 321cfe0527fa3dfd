"""The learning step: the math of one trainer step, apart from the loop and any storage.

`Learner` holds, for one run config, the train state's layout (policy and value-head
params, optimizer state, placed on the trainer mesh when there is one) and the jitted
update of one batch (`Learner.step`); `StepInputs` is a batch as fixed-shape arrays
(`Learner.inputs`). The trainer job (`tpu_jobs.trainer`) runs the loop around it; tests,
benchmarks and `tpu_jobs.learning.memory` drive it directly.

The objective is `losses.compute_loss` with the LossSpec of `trainer.algorithm` and the
config's overrides (`TrainerConfig.loss_overrides`).

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

Judge rows (`rollout.judge_fraction` > 0, see tpu_jobs/rollout_worker.py) carry the judged
solution + suffix as completion-side context with a `loss_mask` of 0, so only the verdict
tokens carry loss, advantage, KL, entropy and alignment statistics; judge groups are groups
like any other (rewards in {0, 1}, normalised within the group). The completion slots then
hold solution + suffix + verdict (`judge.judged_completion_len`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pipeline.config import ModelConfig, RunConfig
from pipeline.lora import LoraConfig
from pipeline.rollouts import RolloutBatch
from pipeline.tokenizer import Tokenizer, get_tokenizer
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
from tpu_jobs.learning.value_head import (
    init_value_head,
    packed_policy_forward,
    packed_policy_forward_and_router,
    policy_forward_and_router,
)
from tpu_jobs.model import mesh as meshlib
from tpu_jobs.model.batching import pack_routing, pack_rows, pad_values
from tpu_jobs.model.judge import judged_completion_len
from tpu_jobs.model.moe import router_loss
from tpu_jobs.model.state import (
    flat_to_state,
    make_optimizer,
    new_lora_model,
    new_model,
    split_lora,
    split_model,
)
from tpu_jobs.model.transformer import init_model, sequence_logprobs

sg = jax.lax.stop_gradient
LORA_DROPOUT_STREAM = 0x10AD  # folded into the seed: LoRA dropout's own key stream


class StepInputs(NamedTuple):
    """One batch as fixed-shape arrays (rows = prompts_per_batch * G; missing groups of a
    dynamic-sampling batch are all-masked rows that contribute nothing)."""

    tokens: Any  # [R, P + C] int32
    mask: Any  # [R, P + C] int32
    comp_mask: Any  # [R, C] float32
    logp_behaviour: Any  # [R, C] float32, the sampler's log-probs
    rewards: Any  # [R] float32
    # [R] float32 loss weights (trainer.judge_loss_weight on judge rows), or None: every
    # row weighs 1 and the programs are those of a run without the weight.
    row_weight: Any = None
    # [R, P + C, layers, k] int32, the sampler's recorded experts to replay (MoE,
    # trainer.routing_replay; `pack_routing`), or None: the trainer's routers choose.
    routing: Any = None
    # [R, C] float32, a teacher's log-probs of the sampled tokens (on-policy distillation,
    # `LossSpec.needs_teacher`: the batch's teacher_logprobs), or None.
    logp_teacher: Any = None


def _arrays(inp: StepInputs, convert: Callable[[Any], Any]) -> StepInputs:
    """`inp` with `convert` applied to each array (the optional ones stay None)."""
    return StepInputs(*(None if x is None else convert(x) for x in inp))


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
    `(logp, entropy | None, values | None)` of the completion tokens, [R, C] each, and the
    router's part of the objective, `(loss, metrics)` of `tpu_jobs.model.moe.router_loss`
    (the load-balancing and z-losses with their coefficients, times `router_weight`: a
    micro-batch's share of its mini-batch, so the summed gradients are the mini-batch's),
    or None for a dense model.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        prompt_len: int,
        temperature: float,
        values: bool,
        entropy: bool,
        lora: LoraConfig | None = None,
        router_weight: float = 1.0,
    ) -> None:
        # The reference (KL terms) is the model without adapters: with LoRA, the frozen base
        # itself (no second copy), merged into the graph of the plain model.
        self.ref_fns, _ = split_model(nnx.eval_shape(lambda: init_model(model_cfg, 0)))
        self.fns = self.ref_fns
        if lora is not None and lora.enabled:
            self.fns, _, _ = split_lora(nnx.eval_shape(lambda: init_model(model_cfg, 0, lora)))
        fns, ref_fns, p = self.fns, self.ref_fns, prompt_len

        # Only the completion's log-probs are taken (`first=p`): the LM head, in chunks of
        # model_cfg.logits_chunk tokens, never runs on the prompt positions. `packing`
        # (`tpu_jobs.learning.packing`, trainer.pack): the same outputs from packed rows.
        # `frozen`: the frozen base of a LoRA run (params["policy"] are its adapters).
        def router_part(router, router_mask):
            if router is None:
                return None
            loss, metrics = router_loss(
                router,
                router_mask,
                model_cfg.router_aux_loss_coef,
                model_cfg.router_z_loss_coef,
            )
            return router_weight * loss, metrics

        def outputs(
            params, tokens, mask, packing=None, frozen=None, dropout_key=None, routing=None
        ):
            if packing is not None:
                out, router = packed_policy_forward_and_router(
                    fns.merge(params["policy"], frozen, dropout_key),
                    packing,
                    mask[:, p:],
                    temperature,
                    params.get("value"),
                    entropy=entropy,
                )
                router = router_part(router, jnp.asarray(packing.segments) > 0)
                return out.logp, out.entropy, out.values, router
            if values or entropy or model_cfg.moe:
                out, router = policy_forward_and_router(
                    fns.merge(params["policy"], frozen, dropout_key),
                    tokens,
                    mask,
                    temperature,
                    params.get("value"),
                    entropy=entropy,
                    first=p,
                    routing=routing,
                )
                return out.logp, out.entropy, out.values, router_part(router, mask)
            model = fns.merge(params["policy"], frozen, dropout_key)
            logp = sequence_logprobs(model, tokens, mask, temperature, first=p)
            return logp, None, None, None

        def forward_vjp(
            params, tokens, mask, packing=None, frozen=None, dropout_key=None, routing=None
        ):
            # Differentiated w.r.t. params only: the frozen base gets no gradient buffers.
            return jax.vjp(
                lambda prm: outputs(prm, tokens, mask, packing, frozen, dropout_key, routing),
                params,
            )

        def ref_logp(ref_params, tokens, mask, packing=None):
            if packing is not None:
                out = packed_policy_forward(
                    ref_fns.merge(ref_params), packing, mask[:, p:], temperature
                )
                return sg(out.logp)
            return sg(ref_fns.logprobs(ref_params, tokens, mask, temperature, first=p))

        # Unjitted, for callers composing their own programs (the fused step).
        self.outputs, self.ref_outputs = outputs, ref_logp
        self.forward = jax.jit(outputs)
        self.forward_vjp = jax.jit(forward_vjp)
        self.backward = jax.jit(lambda vjp_fn, cot: vjp_fn(cot)[0])
        self.ref_logp = jax.jit(ref_logp)


@functools.lru_cache(maxsize=8)
def model_programs(
    model_cfg: ModelConfig,
    prompt_len: int,
    temperature: float,
    values: bool,
    entropy: bool,
    lora: LoraConfig | None = None,
    router_weight: float = 1.0,
) -> ModelPrograms:
    return ModelPrograms(model_cfg, prompt_len, temperature, values, entropy, lora, router_weight)


def _head_loss(spec: LossSpec, group_size: int, recompute: bool):
    """loss(outs, inp, pre, logp_ref, norm) -> (loss, metrics) for one objective."""

    def loss(outs, inp: StepInputs, pre: Prepared | None, logp_ref, norm):
        logp, entropy, values, router = outs
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
            row_weight=inp.row_weight,
            logp_teacher=inp.logp_teacher,
            **extra,
        )
        metrics = dict(metrics)
        if router is not None:  # a MoE model: the router's losses join the objective
            router_value, router_metrics = router
            value = value + router_value
            metrics.update(router_metrics)
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
        logp, _, values, _ = outs
        logp_old = logp if recompute else inp.logp_behaviour
        res = compute_advantages(
            spec,
            inp.rewards,
            inp.comp_mask,
            group_size=group_size,
            logp_old=logp_old,
            logp_ref=logp_ref,
            values=values,
            logp_teacher=inp.logp_teacher,
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


def _placed_shapes(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """`tree`'s `jax.ShapeDtypeStruct`s with the shardings `Learner.place` would give."""
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        tree,
        meshlib.tree_shardings(tree, mesh),
    )


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
        # The judge rows' loss weight, None when it cannot act (no judge groups, or 1).
        self.judge_loss_weight = (
            tc.judge_loss_weight
            if cfg.rollout.judge_groups() and tc.judge_loss_weight != 1.0
            else None
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
                f"fsdp x expert = {multiple} devices, but a (micro-)batch has {self.micro_rows} rows "
                f"(rollout.prompts_per_batch={self.groups} x group_size={self.group_size}, "
                f"trainer.mini_batches={tc.mini_batches}, micro_batch={tc.micro_batch}); "
                f"allowed: a multiple of {multiple} rows (or change mesh.trainer: data * fsdp * "
                "expert must divide it)"
            )
        self.uses_values = self.spec.needs_value_head
        self.needs_ref = self.spec.needs_reference
        self.needs_entropy = self.spec.needs_entropy
        self.recompute = tc.old_logprobs == "recompute"
        self.updates_per_step = tc.mini_batches * tc.epochs
        self.single = self.updates_per_step == 1 and self.micro_rows == self.rows
        # LoRA (`lora.rank` > 0): the train params' policy is the adapters; the frozen base
        # is passed to each step beside them (`step(..., frozen=)`) and is the reference.
        self.lora = cfg.lora if cfg.lora.enabled else None
        self.programs = model_programs(
            cfg.model,
            prompt_len,
            float(cfg.sampler.temperature),
            self.uses_values,
            self.needs_entropy,
            self.lora,
            self.micro_rows / self.mini_rows,
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
        # The frozen base's shapes and dtypes (LoRA; None otherwise): `flat_to_state` of the
        # base snapshot gives the `frozen` argument of `step`.
        self.base_template = None
        if self.lora is not None:
            self.base_template = jax.eval_shape(lambda: new_lora_model(cfg.model, self.lora, 0)[2])
        if abstract:  # shapes only, nothing allocated: for compiling (benchmarks/memory.py)
            self.template = jax.eval_shape(lambda: self.init_params(self.new_policy(0)))
            self.template = self.template, jax.eval_shape(self.tx.init, self.template)
            if mesh is not None:  # the shapes carry the placement `place` would give
                self.template = _placed_shapes(self.template, mesh)
                if self.base_template is not None:  # as `frozen_base` places the base
                    self.base_template = _placed_shapes(self.base_template, mesh)
        else:
            self.template = self.init_state(self.new_policy(cfg.seed))
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

    def new_policy(self, seed: int) -> Any:
        """The policy's trainable params at init: the whole model's, or (LoRA) its adapters
        (A random, B zero: the adapted model is the base)."""
        if self.lora is None:
            return new_model(self.cfg.model, seed)[1]
        return new_lora_model(self.cfg.model, self.lora, seed)[1]

    def _fused_fn(self, loss, apply_fn):
        outputs, ref_outputs = self.programs.outputs, self.programs.ref_outputs

        def step(params, opt_state, ref_params, inp, packing: Packing | None, frozen, dropout_key):
            if self.lora is not None and self.needs_ref:
                ref_params = frozen  # `fused_reference`: the base is the reference
            logp_ref = None
            if ref_params is not None:
                logp_ref = ref_outputs(ref_params, inp.tokens, inp.mask, packing)

            def f(prm):
                outs = outputs(prm, inp.tokens, inp.mask, packing, frozen, dropout_key, inp.routing)
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

    def _grads(self, params, inp: StepInputs, pre: Prepared | None, logp_ref, norm, packing, fixed):
        outs, vjp_fn = self.programs.forward_vjp(
            params, inp.tokens, inp.mask, packing, *fixed, inp.routing
        )
        metrics, cot = self._grad_head(outs, inp, pre, logp_ref, norm)
        return self.programs.backward(vjp_fn, cot), metrics

    def step(
        self, params, opt_state, ref_params, inp: StepInputs, frozen: Any = None, step: int = 0
    ):
        """One trainer step on one batch: (params, opt_state, {metric: float}). `frozen`:
        the frozen base of a LoRA run (`frozen_base`; also its `ref_params`), else None.
        `step`: the trainer step, whose key LoRA dropout draws its masks from."""
        if (frozen is None) != (self.lora is None):
            raise ValueError(
                f"lora.rank={self.cfg.lora.rank}: Learner.step needs frozen= "
                + ("the frozen base (Learner.frozen_base)" if self.lora else "None")
            )
        with self.under_mesh():
            return self._step(params, opt_state, ref_params, inp, (frozen, self.dropout_key(step)))

    def fused_reference(self, ref_params: Any) -> Any:
        """The fused step's `ref_params` argument: the reference when the objective needs
        one, else None. With LoRA, None too: the reference is the frozen base, which the
        program takes once as `frozen` rather than as a second argument (XLA counts each
        argument's bytes, so the memory analysis would show the base twice)."""
        return ref_params if self.needs_ref and self.lora is None else None

    def dropout_key(self, step: int) -> jax.Array | None:
        """LoRA dropout's key of trainer step `step` (its own stream of the run's seed; the
        same masks for every forward of the step, so pi_old and the updates agree); None
        without LoRA dropout."""
        if self.lora is None or self.lora.dropout == 0:
            return None
        root = jax.random.fold_in(jax.random.key(self.cfg.seed), LORA_DROPOUT_STREAM)
        return jax.random.fold_in(root, step)

    def frozen_base(self, flat: dict[str, np.ndarray]) -> Any:
        """The frozen base of a LoRA run from the base snapshot's flat tensors, in
        `lora.base_dtype`, placed on the trainer mesh when there is one."""
        if self.lora is None:
            raise ValueError("frozen_base is for LoRA runs (lora.rank > 0)")
        return self.place(flat_to_state(self.base_template, flat))

    def _step(self, params, opt_state, ref_params, inp: StepInputs, fixed):
        """`fixed`: (the frozen base, the LoRA dropout key), None each without."""
        host = inp  # as given (host arrays from `inputs`): what packing reads
        packing = self._pack(host)  # the whole batch's, for the whole-batch programs
        inp = self._place_batch(_arrays(inp, jnp.asarray))
        logp_ref = None
        if ref_params is not None and self.needs_ref and not self.fused:
            logp_ref = self.programs.ref_logp(ref_params, inp.tokens, inp.mask, packing)
        if self.fused:
            params, opt_state, metrics = self._fused_step(
                params, opt_state, self.fused_reference(ref_params), inp, packing, *fixed
            )
            return params, opt_state, {k: float(v) for k, v in jax.device_get(metrics).items()}
        if self.single:
            grads, metrics = self._grads(params, inp, None, logp_ref, None, packing, fixed)
            params, opt_state, metrics["grad_norm"], finite = self._apply(params, opt_state, grads)
            metrics["nonfinite_updates"] = 1.0 - finite.astype(jnp.float32)
            return params, opt_state, {k: float(v) for k, v in jax.device_get(metrics).items()}
        outs = self.programs.forward(params, inp.tokens, inp.mask, packing, *fixed, inp.routing)
        pre, pre_metrics = self._prepare(outs, inp, logp_ref)
        tc = self.cfg.trainer
        # Each micro-batch is packed once per step (its rows are the same every epoch).
        micro_packings = {}
        if self.cfg.trainer.pack:
            micro_packings = {
                m0: self._pack(_arrays(host, lambda x, m0=m0: x[m0 : m0 + self.micro_rows]))
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
                        fixed,
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
        row_weight = None
        if self.judge_loss_weight is not None:
            row_weight = np.ones(self.rows, np.float32)
            row_weight[:n][batch.is_judge()] = self.judge_loss_weight
        routing = None
        if self.cfg.trainer.routing_replay:  # a batch without the column: nothing recorded
            m = self.cfg.model
            routing = pack_routing(
                list(batch.routing or [None] * n) + [None] * pad,
                [len(p) for p in prompts],
                self.prompt_len,
                self.completion_len,
                (m.num_layers, m.num_experts_per_tok),
                m.num_experts,
            )
        logp_teacher = None
        if self.spec.needs_teacher:
            if batch.teacher_logprobs is None:
                raise ValueError(
                    f"batch {batch.batch_index} has no teacher_logprobs; the objective "
                    f"(advantage={self.spec.advantage!r}, distill_coef="
                    f"{self.spec.distill_coef}) needs them (distill.teacher)"
                )
            logp_teacher = pad_values(
                list(batch.teacher_logprobs) + [[]] * pad, self.completion_len
            )
        return StepInputs(
            tokens, mask, comp_mask, logp_b, rewards, row_weight, routing, logp_teacher
        )
