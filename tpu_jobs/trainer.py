"""The RL trainer: consumes rollout batches in index order, updates, publishes versions.

    python -m tpu_jobs.trainer --run RUN_URL

Load order at start: this run's latest Orbax checkpoint (params, optimizer state, step,
next batch index); else the base model (`base/` snapshot written by the SFT bootstrap
or an HF import). Every start takes a new epoch (fencing token), so an older trainer
still running somewhere can no longer publish.

Step t reads batch t (so replay is deterministic), drops it if it is more than
`max_staleness` versions old, computes the loss, updates, publishes version
t // publish_every when due and checkpoints every `checkpoint_every` steps and on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipeline import failpoints
from pipeline.leases import BatchLeases
from pipeline.paramserver import ParamServer, StaleEpochError
from pipeline.rollouts import RolloutBatch, from_parquet_bytes
from pipeline.run import DONE_KEY, Run
from pipeline.tokenizer import get_tokenizer
from tpu_jobs import checkpoints
from tpu_jobs.batching import pack_rows, pad_values, round_up
from tpu_jobs.losses import compute_loss, loss_spec
from tpu_jobs.sft import base_server
from tpu_jobs.state import flat_to_params, make_optimizer, new_model, params_to_flat


@dataclass
class TrainerState:
    params: Any
    opt_state: Any
    step: int = 0
    next_batch: int = 0
    dropped: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Trainer:
    def __init__(self, run: Run, *, log=print) -> None:
        self.run = run
        self.cfg = run.config
        self.log = log
        self.ps = ParamServer(run.store)
        self.leases = BatchLeases(run.store, ttl_seconds=self.cfg.rollout.lease_seconds)
        tok = get_tokenizer("char")
        problems = run.read_problems("train")
        self.prompt_len = round_up(max(len(tok.encode_prompt(p.prompt)) for p in problems), 8)
        self.completion_len = self.cfg.sampler.max_new_tokens
        self.pad_id = tok.pad_id
        tc = self.cfg.trainer
        self.fns, params = new_model(self.cfg.model, self.cfg.seed)
        self.tx = make_optimizer(tc.lr, tc.warmup_steps, tc.steps, tc.weight_decay, tc.grad_clip)
        self.spec = loss_spec(
            tc.algorithm,
            eps_low=tc.clip_eps,
            eps_high=tc.clip_eps,
            adv_eps=tc.adv_eps,
            kl_coef=tc.kl_coef,
        )
        self.ref_params = None  # the frozen base model, when a KL term needs it
        self._template = (params, self.tx.init(params))
        self._step_fn = jax.jit(self._train_step, donate_argnums=(0, 1))
        self.ckpt = checkpoints.TrainerCheckpoints(run, keep=tc.keep_checkpoints)
        self._stop = False

    # ---------------------------------------------------------------- math
    def _loss(self, params, ref_params, tokens, mask, comp_mask, logp_behaviour, rewards):
        temp = max(self.cfg.sampler.temperature, 1e-6)
        logp = self.fns.logprobs(params, tokens, mask, temp)[:, self.prompt_len :]
        logp_ref = None
        if ref_params is not None:
            logp_ref = self.fns.logprobs(ref_params, tokens, mask, temp)[:, self.prompt_len :]
        loss, metrics = compute_loss(
            self.spec,
            logp,
            logp_behaviour,
            comp_mask,
            rewards=rewards,
            group_size=self.cfg.rollout.group_size,
            logp_ref=None if logp_ref is None else jax.lax.stop_gradient(logp_ref),
        )
        diff = jnp.abs(jax.lax.stop_gradient(logp) - logp_behaviour) * comp_mask
        metrics = dict(metrics)
        metrics["logprob_absdiff_mean"] = diff.sum() / jnp.maximum(comp_mask.sum(), 1.0)
        metrics["logprob_absdiff_max"] = diff.max()
        return loss, metrics

    def _train_step(
        self, params, opt_state, ref_params, tokens, mask, comp_mask, logp_behaviour, rewards
    ):
        (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(
            params, ref_params, tokens, mask, comp_mask, logp_behaviour, rewards
        )
        updates, opt_state = self.tx.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["loss"] = loss
        return optax.apply_updates(params, updates), opt_state, metrics

    # ----------------------------------------------------------- lifecycle
    def restore_or_init(self) -> TrainerState:
        restored = self.ckpt.restore_latest(self._template)
        if restored is not None:
            (params, opt_state), meta = restored
            if meta.get("config_digest") != self.cfg.digest():
                raise RuntimeError(
                    f"checkpoint at step {meta.get('step')} was written by another config "
                    f"({meta.get('config_digest')} != {self.cfg.digest()}); use a new run"
                )
            self.log(f"[trainer] resumed from checkpoint at step {meta['step']}")
            return TrainerState(
                params, opt_state, meta["step"], meta["next_batch"], meta.get("dropped", 0)
            )
        base = base_server(self.run)
        if base.latest_version() is None:
            raise RuntimeError(
                f"run {self.run.url} has no base model and no checkpoint; run the SFT "
                f"bootstrap first: `rlax sft --run {self.run.url}`"
            )
        params = self._base_params()
        self.log(f"[trainer] starting from the base model ({base.store.url})")
        return TrainerState(params, self.tx.init(params))

    def _base_params(self):
        base = base_server(self.run)
        snap = base.pull(base.latest_version())
        return flat_to_params(self.fns, self._template[0], snap.tensors)

    def _publish(self, state: TrainerState, epoch: int) -> None:
        version = state.step // self.cfg.trainer.publish_every
        flat = params_to_flat(self.fns, state.params)
        wrote = self.ps.publish(version, flat, epoch=epoch, metadata={"step": state.step})
        if wrote:
            self.log(f"[trainer] published v{version} (step {state.step})")

    def _wait_for_batch(self, index: int) -> RolloutBatch | None:
        waited = 0.0
        while not self._stop:
            if self.leases.batch_exists(index):
                return from_parquet_bytes(self.leases.read_batch(index))
            time.sleep(self.cfg.rollout.poll_seconds)
            waited += self.cfg.rollout.poll_seconds
            if waited >= 60 and int(waited) % 60 == 0:
                self.log(
                    f"[trainer] still waiting for batch {index} after {waited:.0f}s; is a "
                    f"rollout worker running? `rlax rollout --run {self.run.url}`"
                )
        return None

    def _arrays(self, batch: RolloutBatch):
        tokens, mask, comp_mask = pack_rows(
            batch.prompt_ids,
            batch.completion_ids,
            self.prompt_len,
            self.completion_len,
            self.pad_id,
        )
        logp_b = pad_values(batch.behaviour_logprobs, self.completion_len)
        return tokens, mask, comp_mask, logp_b, batch.reward.astype(np.float32)

    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def train(self) -> TrainerState:
        tc = self.cfg.trainer
        epoch = self.ps.acquire_epoch()
        self.log(f"[trainer] epoch {epoch}")
        state = self.restore_or_init()
        if tc.kl_coef > 0:
            self.ref_params = self._base_params()
        if state.step % tc.publish_every == 0:
            self._publish(state, epoch)  # v0, or a re-publish a crash may have missed
        while state.step < tc.steps and not self._stop:
            t0 = time.time()
            batch = self._wait_for_batch(state.next_batch)
            if batch is None:
                break
            t_wait = time.time() - t0
            version = state.step // tc.publish_every
            staleness = version - batch.policy_version
            if staleness > tc.max_staleness:
                state.dropped += 1
                self.log(
                    f"[trainer] dropped batch {state.next_batch}: version {batch.policy_version}"
                    f" is {staleness} versions old (max_staleness={tc.max_staleness})"
                )
                self.run.log_metrics("dropped", state.next_batch, {"staleness": staleness})
                state.next_batch += 1
                continue
            arrays = self._arrays(batch)
            state.params, state.opt_state, metrics = self._step_fn(
                state.params, state.opt_state, self.ref_params, *arrays
            )
            metrics = {k: float(v) for k, v in metrics.items()}
            state.step += 1
            state.next_batch += 1
            record = {
                **metrics,
                "step": state.step,
                "batch_index": batch.batch_index,
                "reward_mean": float(batch.reward.mean()),
                "completion_tokens_mean": batch.num_tokens() / len(batch),
                "staleness": staleness,
                "policy_version": batch.policy_version,
                "dropped_total": state.dropped,
                "wait_s": t_wait,
                "step_s": time.time() - t0,
            }
            self.run.log_metrics("train", state.step, record)
            self.log(
                f"[trainer] step {state.step}/{tc.steps} reward {record['reward_mean']:.3f} "
                f"loss {metrics['loss']:+.4f} |dlogp| {metrics['logprob_absdiff_mean']:.1e} "
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
            }
            self.run.store.write_new(DONE_KEY, json.dumps(final).encode())
            self.log(f"[trainer] done: {final}")
        return state

    def _meta(self, state: TrainerState, epoch: int) -> dict[str, Any]:
        return {
            "step": state.step,
            "next_batch": state.next_batch,
            "dropped": state.dropped,
            "epoch": epoch,
            "config_digest": self.cfg.digest(),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_jobs.trainer", description=__doc__)
    parser.add_argument("--run", required=True, help="run URL (directory or gs://bucket/prefix)")
    args = parser.parse_args(argv)
    trainer = Trainer(Run.open(args.run), log=lambda m: print(m, flush=True))
    signal.signal(signal.SIGTERM, trainer.request_stop)
    try:
        trainer.train()
    except StaleEpochError as err:
        print(f"[trainer] fenced off by a newer trainer: {err}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
