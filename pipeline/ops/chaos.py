"""`rlax chaos`: kill processes at random during training and prove nothing is lost.

Two runs with the same config and the same base model: an uninterrupted reference, and
a chaos run where a trainer and N rollout workers are SIGKILLed at random moments and
restarted the way an Airflow retry would restart them. At the end the final published
parameters of both must be bit-identical, every batch index must have been produced
exactly once and consumed, and `LATEST` must never have moved backwards.

A run must also prove it tested recovery: at least one kill of the trainer after its first
verified checkpoint, one kill of a worker holding a lease (mid-batch) and one restore from a
checkpoint. The schedule aims the first kills at exactly those moments (then kills at
random), and a run without all three is reported inconclusive (`rlax chaos` exits 1): random
kills alone once all landed before training got going and still reported success.

Beyond the final parameters, every committed rollout batch must be bit-identical to the
reference's of the same index (all columns but the worker that made it), and a run with a
teacher (on-policy distillation, `distill.teacher`: an input both runs name, as they share
data and base) must pin the same teacher, with one verified copy, in both runs.
An engine whose outputs are not bit-reproducible (`sampler.engine: vllm`: its kernels round
with the batch's make-up) cannot pass the bit-identity checks: `ChaosSettings.bit_identity`
off (`rlax chaos --no-bit-identity`) still compares and reports them but judges the run
on the other invariants only (conclusive, nothing lost, nothing produced twice, `LATEST`
monotonic), and the report says so.
`ChaosSettings.failpoints` arms named crash points (`pipeline.failpoints`) in each process
until it kills itself at one, for the moments random kills rarely hit (the teacher's pin, at
startup); such a process is restarted like a killed one, without them.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config import MAX_WORKERS, RunConfig
from pipeline.errors import ArgumentError, check
from pipeline.failpoints import ENV as FAILPOINTS_ENV
from pipeline.failpoints import check_spec as check_failpoints
from pipeline.layout import ROLLOUTS_PREFIX, worker_ids
from pipeline.ops import launcher
from pipeline.paramserver import ParamServer
from pipeline.parquet_bytes import table_from_bytes, table_to_bytes
from pipeline.run import BASE_PREFIX, CHECKPOINT_MANIFESTS, DATA_PREFIX, DONE_KEY, Run
from pipeline.teacher import (
    PIN_KEY,
    TEACHER_CONFIG_KEY,
    TeacherError,
    check_copy,
    read_pin,
    teacher_server,
)

# Batch columns that say who made a batch, not what it is: a redone batch may differ there.
PROVENANCE_COLUMNS = ("worker_id",)


@dataclass(frozen=True)
class ChaosSettings:
    kills: int = 20
    min_interval_s: float = 1.0
    max_interval_s: float = 5.0
    restart_delay_s: float = 0.5
    workers: int = 2
    seed: int = 0
    timeout_s: float = 1800.0
    # RLAX_FAILPOINTS of each process ("teacher.before_pin") until it kills itself at one;
    # its restarts then run without, as a retry after a one-off fault does.
    failpoints: str = ""
    # False: the final parameters and batches are compared and reported, not required to
    # be bit-identical (module docstring; engines that are not bit-reproducible).
    bit_identity: bool = True

    def __post_init__(self) -> None:
        # Named as `rlax chaos` spells them: that is where a bad value comes from.
        for flag, value, ok, allowed in (
            ("--kills", self.kills, self.kills >= 1, ">= 1 (a run without kills proves nothing)"),
            ("--workers", self.workers, 1 <= self.workers <= MAX_WORKERS, f"1..{MAX_WORKERS}"),
            ("--seed", self.seed, self.seed >= 0, ">= 0"),
            ("--min-interval", self.min_interval_s, self.min_interval_s >= 0, ">= 0 seconds"),
            (
                "--max-interval",
                self.max_interval_s,
                self.max_interval_s >= self.min_interval_s,
                f">= --min-interval ({self.min_interval_s})",
            ),
        ):
            check(ok, flag, value, allowed, error=ArgumentError)
        try:
            check_failpoints(self.failpoints)
        except ValueError as err:
            raise ArgumentError(f"--failpoints: {err}") from None


@dataclass
class ChaosStats:
    kills: dict[str, int] = field(default_factory=lambda: {"trainer": 0, "rollout": 0})
    restarts: int = 0
    workers_killed_holding_lease: int = 0
    trainer_killed_after_checkpoint: int = 0
    failpoints_hit: int = 0  # processes that killed themselves at an armed failpoint
    latest_history: list[int] = field(default_factory=list)
    wall_s: float = 0.0


class _LatestMonitor(threading.Thread):
    """Polls LATEST and records every value seen, to check it never moves backwards."""

    def __init__(self, ps: ParamServer, out: list[int]) -> None:
        super().__init__(daemon=True)
        self.ps, self.out, self.stop = ps, out, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                v = self.ps.latest_version()
            except Exception:  # noqa: BLE001 - a torn read mid-CAS is retried next poll
                v = None
            if v is not None and (not self.out or self.out[-1] != v):
                self.out.append(v)
            time.sleep(0.05)


def _copy_prefix(src: Run, dst: Run, prefix: str) -> None:
    for key in src.store.list(prefix):
        dst.store.write_new(key, src.store.read(key))


def prepare(root: str, cfg: RunConfig) -> tuple[Run, Run]:
    """Reference and chaos runs sharing data and one SFT base model."""
    from pipeline.problem_sets import write_data

    ref = Run.create(f"{root.rstrip('/')}/reference", cfg)
    chaos = Run.create(f"{root.rstrip('/')}/chaos", cfg)
    write_data(ref)
    if not ref.store.list(f"{BASE_PREFIX}/"):
        code = launcher.run_job("sft", ref.url)
        if code != 0:
            raise RuntimeError(f"SFT bootstrap of {ref.url} failed with exit code {code}")
    clone_inputs(ref, chaos)
    return ref, chaos


def clone_inputs(src: Run, dst: Run) -> None:
    """Give `dst` the data and the base model of `src`: the same run from its first RL step."""
    for prefix in (f"{DATA_PREFIX}/", f"{BASE_PREFIX}/"):
        _copy_prefix(src, dst, prefix)


def _start(fleet: launcher.Fleet, name: str, env: dict[str, str] | None = None) -> None:
    role, extra = ("train", ()) if name == "trainer" else ("rollout", ("--worker-id", name))
    fleet.start(name, role, extra, env)


def _names(workers: int) -> list[str]:
    return ["trainer", *worker_ids(workers)]


def run_uninterrupted(run: Run, workers: int, timeout_s: float) -> float:
    t0 = time.time()
    fleet = launcher.Fleet(run.url)
    for name in _names(workers):
        _start(fleet, name)
    try:
        while any(fleet.alive(n) for n in fleet.procs):
            fleet.check()
            if time.time() - t0 > timeout_s:
                raise TimeoutError(f"the reference run did not finish within {timeout_s}s")
            time.sleep(0.5)
        fleet.check()
    finally:
        fleet.stop()
    return time.time() - t0


def run_with_chaos(run: Run, s: ChaosSettings, log=print) -> ChaosStats:
    rng = random.Random(s.seed)
    stats = ChaosStats()
    monitor = _LatestMonitor(ParamServer(run.store), stats.latest_history)
    monitor.start()
    names = _names(s.workers)
    fleet = launcher.Fleet(run.url)
    # Each process keeps the failpoints armed until it kills itself at one (a random kill
    # before that point, at startup say, must not disarm it); its restart runs without.
    armed = set(names) if s.failpoints else set()

    def start(name: str) -> None:
        _start(fleet, name, {FAILPOINTS_ENV: s.failpoints} if name in armed else None)

    for name in names:
        start(name)
    procs = fleet.procs
    t0 = time.time()
    next_kill = t0 + rng.uniform(s.min_interval_s, s.max_interval_s)
    next_aim = t0
    try:
        while True:
            if time.time() - t0 > s.timeout_s:
                raise TimeoutError(f"chaos run did not finish within {s.timeout_s}s")
            finished = {n for n, p in procs.items() if p.poll() == 0}
            fleet.check(tolerated=(-signal.SIGKILL,))  # our own kills
            if "trainer" in finished and finished >= set(names):
                break
            # Our kills are restarted at once, so a SIGKILLed process here killed itself.
            for name in [n for n, p in procs.items() if p.returncode == -signal.SIGKILL]:
                log(f"[chaos] {name} killed itself at a failpoint; restarted")
                armed.discard(name)
                start(name)
                stats.failpoints_hit += 1
                stats.restarts += 1
            done = run.store.exists(DONE_KEY)
            total_kills = sum(stats.kills.values())
            live = [n for n, p in procs.items() if p.poll() is None]
            victim = None
            if not done and total_kills < s.kills and live and time.time() >= next_aim:
                # The aimed kills first, the moment their chance comes; random ones only
                # with kills to spare for the aimed ones still to come.
                next_aim = time.time() + 0.25
                victim = _aimed_victim(run, stats, live)
                spare = s.kills - total_kills - _aimed_missing(stats)
                if victim is None and spare > 0 and time.time() >= next_kill:
                    victim = rng.choice(live)
            if victim is not None:
                if victim == "trainer":
                    stats.trainer_killed_after_checkpoint += _has_verified_checkpoint(run)
                else:
                    held = [le for le in _live_leases(run) if le.worker_id == victim]
                    stats.workers_killed_holding_lease += bool(held)
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                stats.kills["trainer" if victim == "trainer" else "rollout"] += 1
                log(
                    f"[chaos] kill {total_kills + 1}/{s.kills}: {victim} at "
                    f"t={time.time() - t0:.1f}s (LATEST v{_latest(run)})"
                )
                time.sleep(s.restart_delay_s)
                start(victim)
                stats.restarts += 1
                next_kill = time.time() + rng.uniform(s.min_interval_s, s.max_interval_s)
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        monitor.stop.set()
        monitor.join()
    stats.wall_s = time.time() - t0
    return stats


def _has_verified_checkpoint(run: Run) -> bool:
    return bool(run.store.list(f"{CHECKPOINT_MANIFESTS}/"))


def _aimed_missing(stats: ChaosStats) -> int:
    return int(not stats.trainer_killed_after_checkpoint) + int(
        not stats.workers_killed_holding_lease
    )


def _aimed_victim(run: Run, stats: ChaosStats, live: list[str]) -> str | None:
    """A kill a conclusive run still needs, if its moment has come: a worker while it holds
    a lease (mid-batch), the trainer once it has a verified checkpoint (its restart then
    restores it)."""
    if not stats.workers_killed_holding_lease:
        holders = {le.worker_id for le in _live_leases(run)} & set(live)
        if holders:
            return min(holders)
    ready = "trainer" in live and _has_verified_checkpoint(run)
    return "trainer" if not stats.trainer_killed_after_checkpoint and ready else None


def _live_leases(run: Run):
    from pipeline.leases import BatchLeases

    return BatchLeases(run.store, ttl_seconds=run.config.rollout.lease_seconds).live_leases()


def _latest(run: Run) -> int | None:
    return ParamServer(run.store).latest_version()


def final_params_equal(a: Run, b: Run) -> tuple[bool, str]:
    pa, pb = ParamServer(a.store), ParamServer(b.store)
    va, vb = pa.latest_version(), pb.latest_version()
    if va != vb:
        return False, f"final versions differ: v{va} vs v{vb}"
    ta, tb = pa.pull(va).tensors, pb.pull(vb).tensors
    if set(ta) != set(tb):
        return False, "tensor names differ"
    for name in sorted(ta):
        x, y = np.asarray(ta[name]), np.asarray(tb[name])
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            diff = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
            return False, f"{name} differs (max abs diff {diff:.3g})"
    return True, f"all {len(ta)} tensors of v{va} bit-identical"


def batches_equal(a: Run, b: Run) -> tuple[bool, str]:
    """Whether `a` and `b` committed the same batch indices, each bit-identical in every
    column but `PROVENANCE_COLUMNS` (the teacher's log-probs included), and if not, the
    first difference."""
    keys = [
        sorted(k for k in r.store.list(f"{ROLLOUTS_PREFIX}/") if k.endswith(".parquet"))
        for r in (a, b)
    ]
    if keys[0] != keys[1]:
        return False, f"committed batches differ: {len(keys[0])} vs {len(keys[1])}"
    columns: list[str] = []
    for key in keys[0]:
        ta, tb = (table_from_bytes(r.store.read(key)) for r in (a, b))
        if ta.column_names != tb.column_names:
            return False, f"{key}: columns {ta.column_names} vs {tb.column_names}"
        columns = [c for c in ta.column_names if c not in PROVENANCE_COLUMNS]
        for name in columns:
            # Parquet stores floats as their IEEE bits: equal bytes are equal bits.
            if table_to_bytes(ta.select([name])) != table_to_bytes(tb.select([name])):
                return False, f"{key}: column {name} differs"
    return True, f"all {len(keys[0])} batches bit-identical ({len(columns)} columns)"


def teachers_equal(a: Run, b: Run) -> tuple[bool | None, str]:
    """None when the runs have no teacher; else whether both pinned the same teacher (the
    same pin.json and teacher config bytes) and hold one copy of it, its digest verified."""
    if not (a.config.distill.enabled or b.config.distill.enabled):
        return None, "no teacher"
    for r in (a, b):
        pin = read_pin(r)
        if pin is None:
            return False, f"{r.url} has no {PIN_KEY}"
        versions = teacher_server(r).versions()
        if versions != [0]:
            return False, f"{r.url} holds teacher versions {versions}; one copy (v0) expected"
        try:
            check_copy(r, pin)
        except TeacherError as err:
            return False, str(err)
    for key in (PIN_KEY, TEACHER_CONFIG_KEY):
        if a.store.read(key) != b.store.read(key):
            return False, f"{key} differs"
    copies = teacher_server(b).current_epoch()
    return True, f"both pinned {read_pin(a).describe()}; copies begun in the chaos run: {copies}"


def account(run: Run, stats: ChaosStats) -> dict[str, Any]:
    """Batches produced / consumed / produced twice / lost, wasted work, restores."""
    steps = run.config.trainer.steps
    batches = batch_accounting(run)
    attempts = batches.pop("attempts")
    trainer_log = launcher.Fleet(run.url).log_path("trainer").read_text(errors="replace")
    step_lines = trainer_log.count("[trainer] step ")
    history = stats.latest_history
    out = {
        "steps": steps,
        "kills": dict(stats.kills),
        "kills_total": sum(stats.kills.values()),
        "restarts": stats.restarts,
        **batches,
        "latest_moved_backwards": any(b < a for a, b in zip(history, history[1:], strict=False)),
        "latest_history": history,
        "checkpoints_restored": trainer_log.count("resumed from checkpoint"),
        "trainer_steps_recomputed": max(0, step_lines - steps),
        "generation_attempts_discarded": sum(1 for a in attempts if not a["committed"]),
        "tokens_discarded": sum(a["tokens"] for a in attempts if not a["committed"]),
        "workers_killed_mid_batch": stats.workers_killed_holding_lease,
        "trainer_killed_after_checkpoint": stats.trainer_killed_after_checkpoint,
        "failpoints_hit": stats.failpoints_hit,
        "chaos_wall_s": round(stats.wall_s, 1),
    }
    missing = [
        what
        for what, n in (
            ("a trainer kill after its first checkpoint", stats.trainer_killed_after_checkpoint),
            ("a worker kill mid-batch", stats.workers_killed_holding_lease),
            ("a restore from a checkpoint", out["checkpoints_restored"]),
        )
        if not n
    ]
    out["conclusive"] = not missing
    out["inconclusive_because"] = "no " + ", no ".join(missing) if missing else ""
    return out


def batch_accounting(run: Run) -> dict[str, Any]:
    """From the bucket alone: rollout batches committed, consumed by the trainer, committed
    twice and lost (a step without its batch), and every generation attempt's record."""
    steps = run.config.trainer.steps
    committed = [
        int(k.split("/b")[1][:8]) for k in run.store.list("rollouts/") if k.endswith(".parquet")
    ]
    attempts = [json.loads(run.store.read(k)) for k in run.store.list("metrics/rollout/")]
    commits_per_index: dict[int, int] = {}
    for a in attempts:
        if a["committed"]:
            commits_per_index[a["batch_index"]] = commits_per_index.get(a["batch_index"], 0) + 1
    consumed = sorted(r["batch_index"] for r in run.read_metrics("train"))
    return {
        "batches_produced": len(committed),
        "batches_consumed": len(set(consumed)),
        "batches_produced_twice": sum(1 for c in commits_per_index.values() if c > 1),
        "batches_lost": len(set(range(steps)) - set(consumed)),
        "attempts": attempts,
    }


def invariants_hold(result: dict[str, Any]) -> bool:
    """Whether a chaos run passed: conclusive, no batch lost or produced twice, `LATEST`
    monotonic, the teacher pinned alike, and (unless the run did not require it,
    `bit_identity_required` false) final parameters and batches bit-identical."""
    bits = result.get("bit_identity_required", True)
    return bool(
        result["conclusive"]
        and (result["identical"] or not bits)
        and (result["batches_identical"] or not bits)
        and result["teacher_identical"] is not False  # None: no teacher
        and result["batches_lost"] == 0
        and not result["latest_moved_backwards"]
        and result["batches_produced_twice"] == 0
    )


def format_report(result: dict[str, Any]) -> str:
    required = result.get("bit_identity_required", True)
    rows = [
        (
            "conclusive (trainer killed after a checkpoint, worker mid-batch, a restore)",
            result["conclusive"] or f"NO: {result['inconclusive_because']}",
        ),
        (
            "bit-identity required",
            "yes"
            if required
            else "NO (--no-bit-identity: compared and reported below, not judged; the run "
            "is judged on the other invariants)",
        ),
        ("invariants hold", invariants_hold(result)),
        ("final parameters bit-identical", result["identical"]),
        ("comparison", result["comparison"]),
        ("rollout batches", result["batches_comparison"]),
        ("teacher (pin and copy)", result["teacher_comparison"]),
        (
            "kills (trainer / rollout)",
            f"{result['kills']['trainer']} / {result['kills']['rollout']}",
        ),
        ("restarts", result["restarts"]),
        (
            "batches produced / consumed",
            f"{result['batches_produced']} / {result['batches_consumed']} of {result['steps']}",
        ),
        ("batches produced twice", result["batches_produced_twice"]),
        ("batches lost", result["batches_lost"]),
        ("LATEST moved backwards", result["latest_moved_backwards"]),
        ("checkpoints restored", result["checkpoints_restored"]),
        ("failpoints hit (process restarted)", result["failpoints_hit"]),
        ("trainer kills after its first checkpoint", result["trainer_killed_after_checkpoint"]),
        ("trainer steps recomputed after a kill", result["trainer_steps_recomputed"]),
        (
            "workers killed mid-batch (lease expired, batch redone)",
            result["workers_killed_mid_batch"],
        ),
        (
            "generation attempts discarded / tokens",
            f"{result['generation_attempts_discarded']} / {result['tokens_discarded']}",
        ),
        (
            "wall time: uninterrupted / chaos",
            f"{result['reference_wall_s']:.1f}s / "
            f"{result['chaos_wall_s']:.1f}s "
            f"({result['chaos_wall_s'] / max(result['reference_wall_s'], 1e-9):.2f}x)",
        ),
    ]
    lines = ["| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def run_chaos(root: str, cfg: RunConfig, settings: ChaosSettings, log=print) -> dict[str, Any]:
    ref, chaos = prepare(root, cfg)
    log(f"[chaos] reference run {ref.url}")
    ref_wall = run_uninterrupted(ref, settings.workers, settings.timeout_s)
    log(f"[chaos] reference finished in {ref_wall:.1f}s; chaos run {chaos.url}")
    stats = run_with_chaos(chaos, settings, log)
    result = account(chaos, stats)
    identical, comparison = final_params_equal(ref, chaos)
    batches_identical, batches_comparison = batches_equal(ref, chaos)
    teacher_identical, teacher_comparison = teachers_equal(ref, chaos)
    result.update(
        identical=identical,
        comparison=comparison,
        batches_identical=batches_identical,
        batches_comparison=batches_comparison,
        teacher_identical=teacher_identical,
        teacher_comparison=teacher_comparison,
        reference_wall_s=round(ref_wall, 1),
        bit_identity_required=settings.bit_identity,
    )
    return result
