"""In-flight rollout batches (`rollout.inflight_batches` > 1): a rollout worker's engine
never waits on a batch's longest row.

One batch at a time, the engine's slots empty as a batch's rows finish and sit idle until
its longest row is done (on the long tail, most of a batch's wall time is that tail).
Here the worker streams batches through one `Engine.stream` call instead:

* the first claimed batch's rows are fed; as soon as they are all admitted and a slot is
  free, the worker claims the next batch and feeds its rows, which enter as the current
  batch's rows finish, as long as fewer than `inflight_batches` batches have rows in
  the engine;
* a batch whose rows are all done is scored (verified), assembled and committed on a
  background thread while the engine decodes the next one;
* only batches pinned to the weights the engine holds join the stream: the next batch
  pinned to another version (`pipeline.rollouts.required_version`) is released and the
  stream drains; the worker then pulls that version and starts a new one. With
  `trainer.publish_every: 1` consecutive batches have their own versions, so streams
  are short after the first `max_staleness + 1` batches: in-flight batches pay with
  `publish_every` > 1 (benchmarks/results/loop.md).

What it gives up (an explicit opt-in, as `sampler.engine: vllm`): a row's log-probs
change in the last bits with the rows it shares a decode program with
(benchmarks/results/row_invariance.md), and those now depend on timing, so a batch is no
longer the same bytes whoever makes it and however often. Its prompts, keys, tokens in
practice, and version are still its own; nothing is lost or made twice (leases and
create-only commits as for one batch at a time).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pipeline.config import RunConfig
from pipeline.leases import BatchLeases, Lease, LeaseLostError
from pipeline.rollouts import RolloutBatch
from pipeline.run import DONE_KEY, Run
from pipeline.tasks.base import Problem
from tpu_jobs.generate.engine import Completion, Engine, Request
from tpu_jobs.generate.interface import check_prompts, sampling_params
from tpu_jobs.generate.sample_verify import score
from tpu_jobs.generate.token_draw import key_data


class BatchMaker(Protocol):
    """What a stream needs of its worker (`tpu_jobs.rollout_worker.RolloutWorker`, which
    imports this module): its claims, a batch's rows, their scoring and assembly, and its
    commits."""

    run: Run
    cfg: RunConfig
    worker_id: str
    tok: Any
    model: Any
    sampler: Any
    leases: BatchLeases
    last_stats: dict[str, Any]
    log: Any

    @property
    def stopping(self) -> bool: ...
    def claim(self) -> Lease | None: ...
    def round_inputs(self, index: int, rnd: int) -> tuple[list[Problem], list[Problem], Any]: ...
    def scored_round(self, rnd: int, problems: list[Problem], scored: Any) -> dict[str, Any]: ...
    def assemble(self, index: int, version: int, parts: list) -> RolloutBatch: ...
    def commit(self, lease: Lease, batch: RolloutBatch, began: float) -> None: ...


@dataclass
class _Open:
    """A batch with rows in the engine: its lease, when it was claimed, its problems and
    prompts, and its rows' completions as they finish."""

    lease: Lease
    began: float
    problems: list[Problem]
    rows: list[Problem]
    prompts: list[list[int]]
    first: int  # the stream index of its row 0
    position: int  # its place in the stream (0: the batch that started it)
    done: list[Completion | None] = field(default_factory=list)
    left: int = 0
    renewed: float = 0.0


class InflightRollouts:
    """One stream of batches through the worker's engine, from `lease` (claimed at
    `began`, its version already loaded) until no batch pinned to that version can be
    claimed and every row is done. `run()` returns when every batch is committed."""

    def __init__(self, worker: BatchMaker, lease: Lease, began: float) -> None:
        if not isinstance(worker.sampler, Engine):
            raise TypeError(
                f"rollout.inflight_batches > 1 needs the jax engine; the worker's sampler is "
                f"{type(worker.sampler).__name__}"
            )
        self.w = worker
        self.engine: Engine = worker.sampler
        self.cfg = worker.cfg
        self.version = lease.version
        self.params = sampling_params(self.cfg, "rollout")
        self.first = (lease, began)
        self.open: dict[int, _Open] = {}  # batch index -> its open batch
        # Batches whose leases this stream holds (open, or waiting for their commit): the
        # heartbeat renews them, under the lock the commit takes before it releases one.
        self.held: dict[int, _Open] = {}
        self.lock = threading.Lock()
        self.beating = threading.Event()
        self.by_row: list[int] = []  # stream index -> batch index
        self.closed = False  # no more batches join this stream
        self.batches = 0  # batches fed so far
        self.tried = 0.0  # when the last claim was tried (time.monotonic)
        self.commits: list[Future[None]] = []
        self.committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commit")

    def run(self) -> None:
        began = time.perf_counter()
        heart = threading.Thread(target=self._heartbeat, name="leases", daemon=True)
        heart.start()
        try:
            served = self.engine.stream(self.w.model, self.params, self._feed, self._done)
            for future in self.commits:
                future.result()  # a failed commit fails the worker
        finally:
            # Whatever failed: the finished batches queued for commit are still written,
            # and the leases of the others given up, so another worker takes them at once.
            self.committer.shutdown(wait=True)
            self.beating.set()
            heart.join()
            with self.lock:
                for batch in self.held.values():
                    with contextlib.suppress(LeaseLostError):
                        self.w.leases.release(batch.lease)
                self.held.clear()
        stats = self.engine.stats
        live = stats["live_row_steps"] / max(stats["decode_row_steps"], 1)
        self.w.log(
            f"[{self.w.worker_id}] {self.batches} batch(es) of v{self.version} in flight, "
            f"{served} rows in {time.perf_counter() - began:.1f}s, {stats['sampled_tokens']:,} "
            f"tokens, {live:.0%} of decode row-steps live"
        )

    # ----------------------------------------------------------------- engine callbacks

    def _feed(self) -> list[Request]:
        for future in self.commits:  # a failed commit stops the stream now, not at its end
            if future.done() and future.exception() is not None:
                raise future.exception()
        if self.first is not None:
            lease, began = self.first
            self.first = None
            return self._open(lease, began)
        if self.closed or len(self.open) >= self.cfg.rollout.inflight_batches:
            return []
        now = time.monotonic()
        if self.open and now - self.tried < self.cfg.rollout.poll_seconds:
            # A claim scans the store's leases: at most one try per poll while rows decode
            # (with none open, an empty answer ends the stream, so try now).
            return []
        self.tried = now
        if self.w.stopping or self.w.run.store.exists(DONE_KEY):
            self.closed = True
            return []
        lease = self.w.claim()
        if lease is None:
            return []
        if lease.version != self.version:
            # Batches are pinned by index, so every later one needs that version too.
            self.w.leases.release(lease)
            self.closed = True
            return []
        return self._open(lease, time.time())

    def _open(self, lease: Lease, began: float) -> list[Request]:
        problems, rows, keys = self.w.round_inputs(lease.index, 0)
        prompts = [self.w.tok.encode_prompt(p.prompt) for p in rows]
        limit = self.params.max_new_tokens
        check_prompts(prompts, limit, self.cfg.model.max_seq_len)
        batch = _Open(
            lease=lease,
            began=began,
            problems=problems,
            rows=rows,
            prompts=prompts,
            first=len(self.by_row),
            position=self.batches,
            done=[None] * len(rows),
            left=len(rows),
            renewed=time.monotonic(),
        )
        self.open[lease.index] = batch
        with self.lock:
            self.held[lease.index] = batch
        self.batches += 1
        self.by_row += [lease.index] * len(rows)
        data = key_data(keys)
        return [Request(p, data[i], limit) for i, p in enumerate(prompts)]

    def _done(self, row: int, completion: Completion) -> None:
        batch = self.open[self.by_row[row]]
        batch.done[row - batch.first] = completion
        batch.left -= 1
        if batch.left == 0:
            del self.open[batch.lease.index]
            self.commits.append(self.committer.submit(self._commit, batch))

    def _heartbeat(self) -> None:
        """Renew the held leases every third of their time to live: a batch claimed
        early waits in the queue for slots, and a finished one for its commit."""
        ttl = self.w.leases.ttl_seconds
        while not self.beating.wait(min(ttl / 6, 5.0)):
            now = time.monotonic()
            with self.lock:
                for batch in self.held.values():
                    if now - batch.renewed <= ttl / 3:
                        continue
                    try:
                        batch.lease = self.w.leases.renew(batch.lease)
                    except LeaseLostError as err:  # another worker may make it; first commit wins
                        self.w.log(f"[{self.w.worker_id}] batch {batch.lease.index}: {err}")
                    batch.renewed = now

    # ----------------------------------------------------------------- commit thread

    def _commit(self, batch: _Open) -> None:
        result = self.engine.result(batch.done, self.params.max_new_tokens)
        scored = score(self.w.tok, batch.rows, batch.prompts, result)
        r = self.w.scored_round(0, batch.problems, scored)
        parts = [(r, np.arange(len(batch.problems)))]
        rollout = self.w.assemble(batch.lease.index, self.version, parts)
        self.w.last_stats["stream_position"] = batch.position  # 0: it started the stream
        with self.lock:  # no renewal races the release
            del self.held[batch.lease.index]
        self.w.commit(batch.lease, rollout, batch.began)
