"""A rollout worker: claim a batch index, pull its policy version, generate, score, commit.

    python -m tpu_jobs.rollout_worker --run RUN_URL [--worker-id NAME]

Any number of workers, started anywhere, cooperate through the run's store alone:
a worker claims the lowest free batch index with a lease object, generates G samples
for each of the batch's prompts with the pinned policy version
(`pipeline.rollouts.required_version`), scores them with the task verifiers and commits
the batch create-only. Sampling keys derive from (seed, batch index, prompt position,
sample index) only, so whichever worker produces a batch, it is the same batch.
A snapshot that fails its checksums is refused and the worker keeps its weights, leaves a
damage report for the trainer (which republishes the version, docs/parameter-server.md,
*Repairs*) and backs off until the report is cleared.
Text is encoded with the run's tokenizer (`model.tokenizer`, `pipeline.tokenizer.run.run_tokenizer`);
with `mesh.sampler` set, the worker samples on a mesh of all its devices (docs/scaling.md).

DAPO's rollout side (Yu et al. 2025), on when the trainer config asks for it
(`TrainerConfig.uses_dynamic_sampling` / `overlong_cache`, DAPO preset): dynamic sampling
drops groups whose G rewards are all equal (zero advantage, no gradient) and refills the
batch from further candidate prompts of the batch's extended deterministic slice, at most
`dynamic_sampling_rounds` rounds; the soft overlong punishment
(`losses.overlong_penalty`) is added to each reward by completion length.

Learning to judge (`RolloutConfig.judge_fraction` > 0): of the batch's prompts_per_batch
group slots, J = `rollout.judge_groups()` are judge groups and the other S = P - J are the
usual solve groups (the batch keeps its fixed size, so the trainer's shapes do not change
with J). After the solve groups are generated and scored, judge group j judges one sampled
solution of round 0 (every round-0 group is generated, whatever dynamic sampling keeps):
a correct one when (batch index + j) is even, a wrong one when it is odd, drawn by a
generator seeded with (seed, batch index) as `rollout.judge_pick` says: over the whole
round ("round", `pick_judged_in_round`) or in same-problem pairs ("problem",
`pick_judged_by_problem`), so judged solutions are balanced. Its G samples are verdicts:
the sampler's prompt is the problem's prompt + the solution, EOS + `JUDGE_SUFFIX`,
with VERDICT_MAX_TOKENS new tokens, keys
from (seed, JUDGE_STREAM, batch index, j, sample), and the reward is `judge_reward` (1 iff
the verdict matches the verifier's grade of the solution). Judge groups come after the
solve groups; dynamic sampling and the overlong punishment act on solve groups only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import uuid
from typing import Any

import jax
import numpy as np

from pipeline import failpoints
from pipeline.environments import make_environment
from pipeline.leases import BatchLeases, Lease
from pipeline.metrics import tool_use_stats
from pipeline.paramserver import CorruptSnapshotError, SnapshotNotFoundError
from pipeline.problem_sets import check_representable
from pipeline.rollouts import RolloutBatch, required_version, routing_dtype, to_parquet_bytes
from pipeline.run import DONE_KEY, Run, policy_reader
from pipeline.schedule import batch_problem_indices
from pipeline.tasks.base import Problem
from pipeline.tasks.judge import judge_context, judge_reward
from tpu_jobs.generate.episodes import sample_rows
from tpu_jobs.generate.inflight import InflightRollouts
from tpu_jobs.generate.interface import sampling_params
from tpu_jobs.generate.policy import load_policy
from tpu_jobs.generate.sample_verify import JUDGE_STREAM, ROLLOUT_STREAM, Scored, sample_keys
from tpu_jobs.generate.teacher import TeacherScorer
from tpu_jobs.learning.losses import filter_constant_groups, overlong_penalty
from tpu_jobs.model.judge import suffix_ids


def pick_judged_in_round(
    verified: np.ndarray, g: int, n_judge: int, index: int, rng: np.random.Generator
) -> list[int]:
    """Rows of the judged solutions, balanced over the whole round: correct when
    (index + j) is even, wrong when odd (the other kind when the round has none), drawn
    without replacement and cycled when a kind runs out. Judging a few fixed slots gave
    mostly wrong solutions at low pass rates, and "always n" then earned most reward."""
    pools = {
        True: list(rng.permutation(np.flatnonzero(verified))),
        False: list(rng.permutation(np.flatnonzero(~verified))),
    }
    rows = []
    for j in range(n_judge):
        want = (index + j) % 2 == 0
        pool = pools[want] or pools[not want]
        i = int(pool.pop(0))
        pool.append(i)
        rows.append(i)
    return rows


def pick_judged_by_problem(
    verified: np.ndarray, g: int, n_judge: int, index: int, rng: np.random.Generator
) -> list[int]:
    """Rows of the judged solutions in same-problem pairs: judge groups 2m and 2m + 1
    judge a correct and a wrong sample of one problem whose group has both, so a verdict
    cannot be told from the problem (its difficulty) alone, only from the solution; the
    round-wide draw when no group is mixed."""
    by_slot = verified.reshape(-1, g)
    mixed = np.flatnonzero(by_slot.any(axis=1) & ~by_slot.all(axis=1))
    if len(mixed) == 0:
        return pick_judged_in_round(verified, g, n_judge, index, rng)
    order = rng.permutation(mixed)
    rows = []
    for j in range(n_judge):
        slot = int(order[(j // 2) % len(order)])
        want = (index + j) % 2 == 0
        rows.append(slot * g + int(rng.choice(np.flatnonzero(by_slot[slot] == want))))
    return rows


# rollout.judge_pick -> how the judged solutions are drawn from the round's samples.
# Back-off of a worker that refused the version it needs (damaged or missing): 2 s, then
# doubling, at most 60 s between pulls; the trainer repairs within a few seconds.
REFUSAL_BACKOFF_S = 2.0
REFUSAL_BACKOFF_CAP_S = 60.0

JUDGE_PICKS = {"round": pick_judged_in_round, "problem": pick_judged_by_problem}


class RolloutWorker:
    """`mesh`: the sampler's device mesh; None takes `mesh.sampler` of the run config
    (None there too: one device)."""

    def __init__(
        self, run: Run, worker_id: str, *, log=print, mesh: jax.sharding.Mesh | None = None
    ) -> None:
        self.run = run
        self.cfg = run.config
        self.worker_id = worker_id
        self.log = log
        # Pulls each version (rebuilt from the one held with the deltas in between; a LoRA
        # run's adapters merged into the base, pipeline.paramserver.adapters).
        self.reader = policy_reader(run)
        self.ps = self.reader.ps
        self.leases = BatchLeases(run.store, ttl_seconds=self.cfg.rollout.lease_seconds)
        self.policy = load_policy(run, "rollout", mesh=mesh)
        self.tok, self.model, self.sampler = self.policy.tok, self.policy.model, self.policy.sampler
        self.mesh = self.policy.mesh
        self.problems = run.read_problems("train")
        # The data job checked the built-in tokenizers; an imported one only exists now.
        check_representable(self.problems, self.tok, run.config.model.tokenizer, "train set")
        self.env = make_environment(self.cfg.environment)
        self.version: int | None = None
        self._stop = False
        self._refused: int | None = None  # the version last refused, and how often in a row
        self._refusals = 0
        self.batches_done = 0
        self.last_stats: dict[str, Any] = {}  # dynamic-sampling / judge stats of the last batch
        # On-policy distillation: the pinned teacher scores every row before it is committed.
        self.teacher = (
            TeacherScorer(run, owner=worker_id, log=log) if self.cfg.distill.enabled else None
        )

    def request_stop(self, *_: Any) -> None:
        self._stop = True

    @property
    def stopping(self) -> bool:
        """Asked to stop (SIGTERM): finish what is in hand, claim nothing more."""
        return self._stop

    def _ensure_version(self, version: int) -> bool:
        if self.version == version:
            return True
        try:
            snap = self.reader.pull(version, held=self.version)
        except (CorruptSnapshotError, SnapshotNotFoundError) as err:
            # Tell the trainer (it republishes the version's exact bits) and back off.
            self.ps.report_refused(version, self.worker_id, str(err))
            self._refusals = self._refusals + 1 if self._refused == version else 1
            self._refused = version
            self.log(
                f"[{self.worker_id}] refused v{version}: {err}; reported it to the trainer "
                f"(weights/refused/), keeping v{self.version} and waiting up to "
                f"{self._backoff_s():.0f}s"
            )
            return False
        self._refused, self._refusals = None, 0
        self.policy.load(snap)
        self.version = version
        return True

    def round_inputs(self, index: int, rnd: int) -> tuple[list[Problem], list[Problem], jax.Array]:
        """Round `rnd` of batch `index`: its P problems (the solve-group candidate slots
        rnd * P .. rnd * P + P - 1, P = prompts_per_batch minus the judge groups), its
        G rows per problem, and one key per row."""
        cfg, tc = self.cfg, self.cfg.trainer
        g, p = cfg.rollout.group_size, cfg.rollout.solve_groups()
        rounds = tc.dynamic_sampling_rounds if tc.uses_dynamic_sampling() else 1
        # Candidate slots of batch i are the deterministic slice [i*R*P, (i+1)*R*P) of the
        # prompt stream (R = 1 without dynamic sampling: the plain batch slice).
        idx = batch_problem_indices(index * rounds + rnd, p, len(self.problems), cfg.seed)
        problems = [self.problems[i] for i in idx]
        rows = [q for q in problems for _ in range(g)]
        return problems, rows, sample_keys(cfg.seed, ROLLOUT_STREAM, index, rnd * p, p, g)

    def _generate_round(self, index: int, rnd: int) -> dict[str, Any]:
        """Round `rnd` of batch `index` (`round_inputs`), sampled and scored."""
        cfg = self.cfg
        problems, rows, keys = self.round_inputs(index, rnd)
        scored = sample_rows(  # tool episodes when the run sets an environment
            self.sampler,
            self.model,
            self.tok,
            cfg.environment,
            rows,
            keys,
            sampling_params(cfg, "rollout"),
            env=self.env,
            batch_size=-(-len(rows) // cfg.rollout.sample_chunks),
        )
        return self.scored_round(rnd, problems, scored)

    def scored_round(self, rnd: int, problems: list[Problem], scored: Scored) -> dict[str, Any]:
        """A round's sampled and verified rows as `generate_batch` assembles them (the
        rewards overlong-shaped; "verified" keeps the verifier's own)."""
        tc, p = self.cfg.trainer, len(problems)
        rewards = scored.rewards
        verified = rewards.copy()
        longest = self.cfg.completion_tokens()
        cache = tc.overlong_cache(longest)
        if cache > 0:  # DAPO soft overlong punishment, added to the verifier's reward
            pen = overlong_penalty(scored.lengths, longest, cache)
            rewards = (rewards + pen).astype(np.float32)
        return {
            "scored": scored,
            "problems": problems,
            "slots": np.arange(p) + rnd * p,
            "prompts": scored.prompt_ids,
            "completions": scored.completion_ids,
            "texts": scored.texts,
            "logps": scored.logprobs,
            "rewards": rewards,
            "verified": verified,
            "finished": scored.finished,
            "verify_s": scored.verify_s,
            "verify_wait_s": scored.verify_wait_s,
        }

    def _judge_groups(self, index: int, r: dict[str, Any]) -> dict[str, list[Any]]:
        """The batch's judge groups (module docstring), judging solutions of round `r`."""
        cfg = self.cfg
        g, n_judge = cfg.rollout.group_size, cfg.rollout.judge_groups()
        n_slots = len(r["problems"])
        suffix = suffix_ids(self.tok)
        rng = np.random.default_rng([cfg.seed, JUDGE_STREAM, index])
        verified = np.asarray(r["verified"][: n_slots * g]) >= 1.0
        pick = JUDGE_PICKS[cfg.rollout.judge_pick]
        picks = [(i // g, i) for i in pick(verified, g, n_judge, index, rng)]
        contexts = [judge_context(r["completions"][i], suffix, self.tok.eos_id) for _, i in picks]
        prompts = [r["prompts"][i] + ctx for (_, i), ctx in zip(picks, contexts, strict=True)]
        out = self.sampler.generate(
            self.model,
            [pr for pr in prompts for _ in range(g)],
            sample_keys(cfg.seed, JUDGE_STREAM, index, 0, n_judge, g),
            sampling_params(cfg, "judge"),  # rollouts too: the solve groups' settings
        )
        cols: dict[str, list[Any]] = {
            k: [] for k in ("pos", "prob", "pr", "co", "tx", "lp", "rw", "fin", "mask")
        }
        for j, ((slot, i), ctx) in enumerate(zip(picks, contexts, strict=True)):
            correct = bool(r["verified"][i] >= 1.0)
            for s in range(g):
                row = j * g + s
                n = int(out.lengths[row])
                verdict = out.tokens[row, :n].tolist()
                completion = ctx + verdict
                cols["pos"].append(int(r["slots"][slot]))
                cols["prob"].append(r["problems"][slot])
                cols["pr"].append(r["prompts"][i])
                cols["co"].append(completion)
                cols["tx"].append(self.tok.decode(completion))
                cols["lp"].append([0.0] * len(ctx) + out.logprobs[row, :n].tolist())
                cols["rw"].append(judge_reward(self.tok.decode(verdict), correct))
                cols["fin"].append(bool(out.finished[row]))
                cols["mask"].append([0] * len(ctx) + [1] * n)
        return cols

    def generate_batch(self, index: int, version: int) -> RolloutBatch:
        """The batch: G samples for each of prompts_per_batch prompts.

        With dynamic sampling (DAPO), groups whose G rewards are all equal are dropped and
        further candidate prompts are generated, round by round, until prompts_per_batch
        groups with unequal rewards are found or `dynamic_sampling_rounds` rounds are used;
        the batch then holds only those groups (possibly fewer, possibly none). Keys still
        depend only on (seed, batch index, candidate slot, sample), so the batch is the same
        whoever makes it. `prompt_pos` holds each group's candidate slot.

        With learning to judge, P = the solve groups (prompts_per_batch - judge groups)
        and the judge groups follow them (module docstring).
        """
        cfg, tc = self.cfg, self.cfg.trainer
        g, p = cfg.rollout.group_size, cfg.rollout.solve_groups()
        dynamic = tc.uses_dynamic_sampling()
        rounds = tc.dynamic_sampling_rounds if dynamic else 1
        parts: list[tuple[dict[str, Any], np.ndarray]] = []
        kept = 0
        for rnd in range(rounds):
            r = self._generate_round(index, rnd)
            keep = filter_constant_groups(r["rewards"], g) if dynamic else np.ones(p, bool)
            take = np.flatnonzero(keep)[: p - kept]
            parts.append((r, take))
            kept += len(take)
            if kept >= p:
                break
        return self.assemble(index, version, parts)

    def assemble(
        self, index: int, version: int, parts: list[tuple[dict[str, Any], np.ndarray]]
    ) -> RolloutBatch:
        """Batch `index` of version `version` from its scored rounds (`scored_round`), each
        with the groups it keeps, plus its judge groups and teacher scores; sets
        `last_stats`."""
        cfg = self.cfg
        g, p = cfg.rollout.group_size, cfg.rollout.solve_groups()
        kept = sum(len(take) for _, take in parts)
        self.last_stats = {
            "ds_candidates": p * len(parts),
            "ds_kept": kept,
            "ds_rounds": len(parts),
            # Time in the verifiers, and the part of it generation did not hide (the
            # share of the step spent waiting on the sandbox, for sandboxed families).
            "verify_s": sum(r["verify_s"] for r, _ in parts),
            "verify_wait_s": sum(r["verify_wait_s"] for r, _ in parts),
        }
        episodes = cfg.environment.multi_turn
        if episodes:  # the time split of tool episodes (the report's generation/tool split)
            self.last_stats["generate_s"] = sum(r["scored"].generate_s for r, _ in parts)
            self.last_stats["tool_s"] = sum(r["scored"].tool_s for r, _ in parts)
            self.last_stats["tool_wait_s"] = sum(r["scored"].tool_wait_s for r, _ in parts)
            every = [r["scored"] for r, _ in parts]  # every generated episode, kept or not
            self.last_stats["tools"] = tool_use_stats(
                [t for s in every for t in s.turns],
                [c for s in every for c in s.tool_calls],
                [e for s in every for e in s.tool_errors],
            )
        cols: dict[str, list[Any]] = {k: [] for k in ("pos", "prob", "pr", "co", "tx", "lp", "rw")}
        # Routing replay: the solve rows' recorded experts, flattened (pipeline.rollouts).
        routing: list[np.ndarray] | None = [] if self.records_routing(parts) else None
        fin: list[bool] = []
        masks: list[list[int] | None] = []
        ep_cols: dict[str, list[Any]] = {"turns": [], "tool_calls": [], "tool_errors": []}
        for r, take in parts:
            scored = r["scored"]
            for j in take:
                rows = range(j * g, (j + 1) * g)
                cols["pos"] += [int(r["slots"][j])] * g
                cols["prob"] += [r["problems"][j]] * g
                cols["pr"] += [r["prompts"][i] for i in rows]
                cols["co"] += [r["completions"][i] for i in rows]
                cols["tx"] += [r["texts"][i] for i in rows]
                cols["lp"] += [r["logps"][i] for i in rows]
                cols["rw"] += [float(r["rewards"][i]) for i in rows]
                fin += [bool(r["finished"][i]) for i in rows]
                if routing is not None:
                    routing += [scored.routing[i].reshape(-1) for i in rows]
                masks += [scored.loss_masks[i] if episodes else None for i in rows]
                for name in ep_cols:
                    ep_cols[name] += [getattr(scored, name)[i] for i in rows] if episodes else []
        kind = ["solve"] * len(fin)
        n_judge = cfg.rollout.judge_groups()
        if n_judge:
            judge = self._judge_groups(index, parts[0][0])
            for k in ("pos", "prob", "pr", "co", "tx", "lp", "rw"):
                cols[k] += judge[k]
            fin += judge["fin"]
            kind += ["judge"] * len(judge["fin"])
            masks += judge["mask"]
            if routing is not None:  # not recorded: the trainer routes judge rows itself
                routing += [
                    self._unrecorded(pr, co)
                    for pr, co in zip(judge["pr"], judge["co"], strict=True)
                ]
            self.last_stats["judge_groups"] = n_judge
            self.last_stats["judge_reward_mean"] = float(np.mean(judge["rw"]))
        teacher_logprobs = None
        if self.teacher is not None:
            t0 = time.perf_counter()
            teacher_logprobs = self.teacher.score(cols["pr"], cols["co"], masks)
            self.last_stats["teacher_s"] = time.perf_counter() - t0
        return RolloutBatch(
            batch_index=index,
            prompt_pos=np.asarray(cols["pos"], np.int64),
            prompt_id=[q.problem_id for q in cols["prob"]],
            task=[q.task for q in cols["prob"]],
            sample_index=np.tile(np.arange(g), kept + n_judge),
            prompt_ids=cols["pr"],
            completion_ids=cols["co"],
            behaviour_logprobs=cols["lp"],
            completion=cols["tx"],
            finished=np.asarray(fin, bool),
            reward=np.asarray(cols["rw"], np.float32),
            policy_version=version,
            worker_id=self.worker_id,
            kind=kind if n_judge else None,
            loss_mask=masks if n_judge or episodes else None,
            **({name: values for name, values in ep_cols.items()} if episodes else {}),
            routing=routing,
            teacher_logprobs=teacher_logprobs,
        )

    def records_routing(self, parts: list[tuple[dict[str, Any], np.ndarray]]) -> bool:
        """Whether the batch carries the sampler's routing (`trainer.routing_replay` on a
        MoE model whose sampler recorded it for every round)."""
        return self.cfg.trainer.routing_replay and all(
            r["scored"].routing is not None for r, _ in parts
        )

    def _unrecorded(self, prompt: list[int], completion: list[int]) -> np.ndarray:
        """A row's routing record with nothing recorded (every entry the mark E)."""
        m = self.cfg.model
        size = (len(prompt) + len(completion)) * m.num_layers * m.num_experts_per_tok
        return np.full(size, m.num_experts, routing_dtype(m.num_experts))

    def run_forever(self) -> int:
        while not self._stop:
            if self.run.store.exists(DONE_KEY):
                break
            lease = self.claim()
            if lease is None:
                time.sleep(self.cfg.rollout.poll_seconds)
                continue
            t0 = time.time()
            if not self._ensure_version(lease.version):
                self.leases.release(lease)
                self._wait_for_repair(lease.version)
                continue
            if self.cfg.rollout.inflight_batches > 1:
                InflightRollouts(self, lease, t0).run()
                continue
            self.commit(lease, self.generate_batch(lease.index, lease.version), t0)
        return self.batches_done

    def claim(self) -> Lease | None:
        """The lease of the lowest batch no one holds whose pinned version is published
        (renewed with that version, which retention then protects); None if there is none."""
        tc = self.cfg.trainer
        latest = self.ps.latest_version()
        if latest is None:
            return None
        limit = min(tc.steps + self._dropped(), (latest + tc.max_staleness + 1) * tc.publish_every)
        lease = self.leases.claim_next(0, self.worker_id, latest, limit=limit)
        if lease is None:
            return None
        version = required_version(lease.index, tc.publish_every, tc.max_staleness)
        return self.leases.renew(lease, version=version)

    def commit(self, lease: Lease, batch: RolloutBatch, began: float) -> None:
        """Write `batch` (first writer wins), give its lease up, record and log the attempt;
        `began`: when its lease was claimed (time.time())."""
        index, version = batch.batch_index, batch.policy_version
        failpoints.hit("rollout.before_commit", index)
        committed = self.leases.commit_batch(index, to_parquet_bytes(batch))
        self.leases.release(lease)
        self.batches_done += committed
        dt = time.time() - began
        self._record_attempt(batch, committed, dt)
        reward = float(batch.reward.mean()) if len(batch) else float("nan")
        self.log(
            f"[{self.worker_id}] batch {index} v{version} reward {reward:.3f} "
            f"{len(batch) // self.cfg.rollout.group_size} groups "
            + (
                f"(judge reward {self.last_stats['judge_reward_mean']:.3f}) "
                if "judge_reward_mean" in self.last_stats
                else ""
            )
            + f"{batch.num_tokens() / dt:,.0f} tok/s"
            + ("" if committed else " (already committed by another worker; discarded)")
        )

    def _backoff_s(self) -> float:
        """How long to wait after the latest refusal: doubling with each refusal of the
        same version in a row, capped (a damaged version costs the store one small read
        per poll, not a re-read of the whole chain every second)."""
        return min(REFUSAL_BACKOFF_CAP_S, REFUSAL_BACKOFF_S * 2 ** (self._refusals - 1))

    def _wait_for_repair(self, version: int) -> None:
        """Back off after refusing ``version``, waking early once the trainer has acted on
        the damage report (deleted it: the version was repaired) or the run is done."""
        deadline = time.monotonic() + self._backoff_s()
        while not self._stop and time.monotonic() < deadline:
            time.sleep(self.cfg.rollout.poll_seconds)
            if not self.ps.report_pending(version, self.worker_id):
                return
            if self.run.store.exists(DONE_KEY):
                return

    def _record_attempt(self, batch: RolloutBatch, committed: bool, seconds: float) -> None:
        """One record per generated batch, so duplicated (wasted) work can be counted."""
        record = {
            "batch_index": batch.batch_index,
            "worker_id": self.worker_id,
            "policy_version": batch.policy_version,
            "committed": bool(committed),
            "tokens": batch.num_tokens(),
            "reward_mean": float(batch.reward.mean()) if len(batch) else None,
            "seconds": seconds,
            "time": time.time(),  # when it was committed (the loop benchmark's busy intervals)
            **self.last_stats,
        }
        key = f"metrics/rollout/b{batch.batch_index:08d}-{uuid.uuid4().hex[:12]}.json"
        self.run.store.write_new(key, json.dumps(record, sort_keys=True).encode())

    def _dropped(self) -> int:
        return len(self.run.store.list("metrics/dropped/"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_jobs.rollout_worker", description=__doc__)
    parser.add_argument("--run", required=True, help="run URL (directory or gs://bucket/prefix)")
    parser.add_argument("--worker-id", default=f"{socket.gethostname()}-{os.getpid()}")
    args = parser.parse_args(argv)
    run = Run.open(args.run)
    run.config.sandbox.apply()  # verifiers' programs: the local pool or the run's service
    worker = RolloutWorker(run, args.worker_id, log=lambda m: print(m, flush=True))
    signal.signal(signal.SIGTERM, worker.request_stop)
    n = worker.run_forever()
    print(f"[{args.worker_id}] exiting after {n} batches", flush=True)
    return 0


if __name__ == "__main__":
    from pipeline.entrypoint import run_main

    sys.exit(run_main("rollout", main))
