"""The RL trainer: consumes rollout batches in index order, updates, publishes versions.

    python -m tpu_jobs.trainer --run RUN_URL

Load order at start: this run's latest Orbax checkpoint (policy and value-head params,
optimizer state, step, next batch index, counters); else the base model (`base/` snapshot
written by the SFT bootstrap or an HF import). With LoRA (`lora.rank` > 0) the policy's
params are its adapters, the `base/` snapshot is the frozen base (and the KL reference),
versions are adapters naming the base by digest, and a checkpoint of another base is
refused (`pipeline.paramserver.adapters`). Every start takes a new epoch (fencing
token), so an older trainer still running somewhere can no longer publish. Text is encoded
with the run's tokenizer (`model.tokenizer`). With `mesh.trainer` set, the train state and
batches live on a mesh of all the process's devices (`Learner`, docs/scaling.md); with
`mesh.distributed`, `jax.distributed` starts first (multi-host, see `Trainer`).

Step t reads batch t (so replay is deterministic), drops it if it is more than
`max_staleness` versions old (or holds no group at all: DAPO's dynamic sampling), computes the
loss, updates, publishes version t // publish_every when due and checkpoints every
`checkpoint_every` steps and on SIGTERM. A version a rollout worker reports damaged (and
still needs) is republished with its exact bits from the trainer's parameters, an intact
chain in the store or the checkpoint of its step; where none has them the trainer stops
with exit code 4 and one line (docs/parameter-server.md, *Repairs*).

The step itself (the objective, pi_old, the loss mask, judge rows) is
`tpu_jobs.learning.step.Learner`, which holds the math without any storage; publishing
(full or delta versions, the delta base, retention, repairs) is the parameter server's
`pipeline.paramserver.publishing.Publisher`, fed the policy's host arrays. This module is
the loop between them. Each step logs `solve_reward_mean` and, when the batch has judge
rows (`rollout.judge_fraction` > 0), `judge_reward_mean` (the judge's accuracy on the
batch's own solutions).
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipeline import failpoints
from pipeline.batch_checks import BadBatchError, BatchLimits, read_checked
from pipeline.config import RunConfig
from pipeline.leases import BatchLeases
from pipeline.mesh import piece_axis
from pipeline.metrics import tool_use_stats
from pipeline.paramserver import StaleEpochError, UnrecoverableVersionError
from pipeline.paramserver.adapters import server_base_digest
from pipeline.paramserver.publishing import Publisher, PublishPolicy
from pipeline.rollouts import RolloutBatch, required_version
from pipeline.run import (
    CHECKPOINTS_PREFIX,
    DONE_KEY,
    Run,
    RunError,
    base_server,
    start_adapter_server,
    weights_server,
)
from pipeline.storage import ObjectNotFound
from pipeline.tasks.base import REWARD_RANGE
from pipeline.tokenizer.run import run_tokenizer
from tpu_jobs.learning import checkpoints
from tpu_jobs.learning.step import Learner
from tpu_jobs.model import mesh as meshlib
from tpu_jobs.model.batching import round_up
from tpu_jobs.model.state import flat_to_params, flat_to_state, params_to_flat, state_to_flat


class IntegrityError(RuntimeError):
    """Too many refused batches or non-finite steps in a row: the run cannot go on. (A
    weight version the run still needs and no exact copy of is
    `paramserver.UnrecoverableVersionError`; both stop the trainer with exit code 4.)"""


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


def publish_policy(cfg: RunConfig, base_digest: str | None = None) -> PublishPolicy:
    """The run's publishing policy (`pipeline.paramserver.publishing`); `base_digest`: a
    LoRA run's base (its versions are adapters, `pipeline.paramserver.adapters`)."""
    pc, tc = cfg.paramserver, cfg.trainer
    lora = {}
    if cfg.lora.enabled:
        lora = {"base_digest": base_digest, "lora_scale": cfg.lora.scale}
    return PublishPolicy(
        dtype=pc.publish_dtype(cfg.sampler.dtype),
        parts=pc.parts(cfg.mesh.sampler),
        full_every=pc.full_every,
        publish_every=tc.publish_every,
        keep_versions=tc.keep_versions,
        max_staleness=tc.max_staleness,
        # A lease on a machine whose clock runs behind is still honoured (pipeline.retention).
        clock_skew_s=min(30.0, cfg.rollout.lease_seconds),
        **lora,
    )


class _TrainerCopies:
    """What a trainer at `state` holds of published versions besides the store
    (`publishing.HeldCopies`): its parameters and its checkpoints."""

    def __init__(self, trainer: Trainer, state: TrainerState) -> None:
        self.trainer, self.state = trainer, state
        self.checkpoints_url = trainer.run.store.url_of("checkpoints/")

    def parameters(self) -> dict[str, np.ndarray]:
        return self.trainer.published_tensors(self.state.params["policy"])

    def checkpoint(self, step: int) -> dict[str, np.ndarray] | str:
        trainer = self.trainer
        # Only process 0 heals, and a restore is a collective across a multi-host trainer.
        if jax.process_count() > 1:
            return "a multi-host trainer does not restore single checkpoints to repair"
        restored = trainer.ckpt.restore_step(step, trainer._template)
        if isinstance(restored, str):
            return restored
        (params, _), meta = restored
        if meta.get("config_digest") not in trainer.run.config_digests():
            return f"the checkpoint of step {step} was written by another config"
        if meta.get("base_digest") != trainer.base_digest:
            return f"the checkpoint of step {step} holds adapters of another base"
        return trainer.published_tensors(params["policy"])


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
        # LoRA: the base the adapters train on, by digest (pipeline.paramserver.adapters):
        # named by every version's manifest and every checkpoint. None without LoRA.
        self.base_digest: str | None = None
        if self.cfg.lora.enabled:
            self.base_digest = server_base_digest(base_server(run))[1]
        self.publisher = Publisher(
            self.ps,
            self.leases,
            publish_policy(self.cfg, self.base_digest),
            functools.partial(meshlib.split_axes, axis=piece_axis(self.cfg.mesh.sampler)),
            log=lambda line: self.log(f"[trainer] {line}"),  # self.log as it is then
        )
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
        self.frozen = None  # LoRA: the frozen base the adapters are trained on
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
            if meta.get("base_digest") != self.base_digest:
                raise RunError(
                    f"checkpoint at step {meta.get('step')} holds LoRA adapters of base "
                    f"{meta.get('base_digest')}, but the run's base/ is {self.base_digest}; "
                    "restore the base it was trained on, or start a new run"
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
        if self.learner.lora is None:
            params, opt_state = self.learner.init_state(self._base_params())
        else:
            params, opt_state = self.learner.init_state(self._start_adapters())
        self.log(f"[trainer] starting from the base model ({base.store.url})")
        return TrainerState(params, opt_state)

    def _base_params(self):
        """The base model's params (the whole policy's; LoRA: the frozen base's state)."""
        base = base_server(self.run)
        snap = base.pull(base.latest_version())
        if self.learner.lora is not None:
            return self.learner.frozen_base(snap.tensors)  # its own buffers (a dtype cast)
        params = flat_to_params(self.learner.fns, self._template[0]["policy"], snap.tensors)
        # Own buffers: arrays made from one (cached) snapshot may alias host memory, and the
        # train state is donated to the step while the reference copy must stay alive.
        return self.learner.place(jax.tree.map(lambda x: jnp.array(x, copy=True), params))

    def _start_adapters(self):
        """A LoRA run's adapters at step 0: the imported PEFT adapter when there is one
        (`rlax import-hf --adapter`, `pipeline.run.start_adapter_server`), else fresh ones
        (B = 0: version 0 is the base itself)."""
        fresh = self.learner.new_policy(self.cfg.seed)
        start = start_adapter_server(self.run)
        if 0 not in start.versions():
            return fresh
        self.log(f"[trainer] starting adapters: the imported adapter ({start.store.url})")
        return self.learner.place(flat_to_state(fresh, start.pull(0).tensors))

    def _publish(self, state: TrainerState, epoch: int) -> None:
        version = state.step // self.cfg.trainer.publish_every
        policy = state.params["policy"]
        if jax.process_count() > 1:  # a collective: every process gathers the global arrays
            policy = meshlib.to_host(policy)
        if not self.primary:
            return
        self.publisher.publish(
            version,
            self.published_tensors(policy),
            epoch=epoch,
            step=state.step,
            next_batch=state.next_batch,
        )

    def published_tensors(self, policy: Any) -> dict[str, np.ndarray]:
        """The flat host tensors a version holds: the policy's, or a LoRA run's adapters."""
        if self.learner.lora is not None:
            return state_to_flat(policy)
        return params_to_flat(self.learner.fns, policy)

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
            num_experts=cfg.model.num_experts,
            routing_width=cfg.model.num_layers * cfg.model.num_experts_per_tok,
            teacher=cfg.distill.enabled,
        )

    def _heal(self, state: TrainerState) -> None:
        """Act on the rollout workers' damage reports (`Publisher.heal`): a version the run
        still needs is republished with its exact bits from the trainer's parameters, an
        intact chain in the store or the checkpoint of its step."""
        self.publisher.heal(
            step=state.step,
            next_batch=state.next_batch,
            epoch=self.epoch,
            copies=_TrainerCopies(self, state),
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
        if self.learner.lora is not None:
            # The reference of KL terms is the base with the adapters off: the same arrays.
            self.frozen = self._base_params()
            self.ref_params = self.frozen if self.learner.needs_ref else None
        elif self.learner.needs_ref:
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
                state.params, state.opt_state, self.ref_params, inputs, self.frozen, state.step
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
        # A LoRA checkpoint names the base its adapters need (refused on another base).
        lora = {} if self.base_digest is None else {"base_digest": self.base_digest}
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
            **lora,
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
    except (IntegrityError, UnrecoverableVersionError, checkpoints.CheckpointCorruptError) as err:
        print(f"[trainer] stopped: {err}", file=sys.stderr, flush=True)
        return 4
    return 0


if __name__ == "__main__":
    from pipeline.entrypoint import run_main

    sys.exit(run_main("trainer", main))
