"""The parameter server and the whole loop at RLAX's scale (docs/scale-model.md explains both).

For the seeds' setting (a 32B model, 1,024 TPU v5p chips split between the trainer and
inference hosts, a new version every step) it prints, per way of publishing: the bytes per
version, what each inference host downloads, the aggregate GCS egress per hour, the time to
get a version to every host against the step time, the request rates against GCS's
published limits, and what breaks first with the knob that fixes it.

Then the whole loop, as a discrete-event simulation (`simulate`): the trainer consuming
batch t at step t and publishing a version per step, rollout workers (one per sampler
replica) claiming batches in index order once their pinned version
(`pipeline.rollouts.required_version`) is published, pulling it (the parameter server's
bytes and rates above, through the project's egress) and generating each batch with
continuous batching on a roofline of a v5p replica, with lengths drawn from the measured
long tail (or a file of lengths). For synchronous, asynchronous and in-flight modes it
prints the time per step, tokens trained per second, where the trainer's and the
replicas' slots' time went, and what limits the step.

The delta size comes from the measured ratio of benchmarks/results/paramserver_deltas.json
(a real RL run publishing bfloat16 versions) unless `--delta-ratio` is given. Everything
else is an argument whose default is stated in docs/scale-model.md, with its source or
marked as an assumption.

    .venv/bin/python benchmarks/scale_model.py [--params 32e9] [--step-s 60] ...
    .venv/bin/python benchmarks/scale_model.py --part loop --staleness 0,1 --lengths FILE
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.rollouts import required_version  # noqa: E402

MEASURED = Path(__file__).resolve().parent / "results" / "paramserver_deltas.json"
GB = 1e9

# GCS limits (docs/scale-model.md cites their pages).
INITIAL_READS_PER_S = 5000  # per bucket, before auto-scaling
INITIAL_WRITES_PER_S = 1000  # per bucket, before auto-scaling
RAMP_DOUBLING_S = 20 * 60  # ramp-up: at most double the request rate every 20 minutes
SAME_OBJECT_WRITES_PER_S = 1.0  # writes to one object name (LATEST)


@dataclass(frozen=True)
class Setting:
    params: float = 32e9
    chips: int = 1024
    trainer_chips: int = 512
    chips_per_host: int = 4  # a TPU v5p host (VM) has 4 chips
    sampler_tp: int = 8  # tensor ranks of one sampler replica
    step_s: float = 60.0  # a version every step
    host_gbps: float = 100.0  # a host's network (assumption)
    stream_mb_s: float = 150.0  # one GCS read stream (assumption)
    pull_concurrency: int = 8
    range_mib: int = 16
    shard_mib: int = 64
    full_every: int = 10
    egress_quota_gbps: float = 200.0  # the project's GCS egress quota (assumption)
    delta_ratio: float = 5.0  # full bf16 bytes / delta bytes (measured: --from-results)
    poll_s: float = 2.0  # rollout.poll_seconds: LATEST reads per host

    @property
    def inference_hosts(self) -> int:
        return (self.chips - self.trainer_chips) // self.chips_per_host

    @property
    def host_fraction(self) -> float:
        """Share of each weight one inference host needs: all of it when a replica fits in
        a host, 1/(hosts per replica) when the tensor ranks span hosts (shard-wise pulls)."""
        return min(1.0, self.chips_per_host / self.sampler_tp)


@dataclass(frozen=True)
class Mode:
    name: str
    dtype_bytes: int
    delta: bool
    shard_wise: bool


MODES = (
    Mode("full float32, whole model per host (before)", 4, False, False),
    Mode("full bfloat16, whole model per host", 2, False, False),
    Mode("bfloat16 deltas, whole model per host", 2, True, False),
    Mode("bfloat16 deltas, shard-wise pulls", 2, True, True),
)


def version_bytes(s: Setting, m: Mode) -> tuple[float, float]:
    """Bytes of one full snapshot and of one delta of the model."""
    full = s.params * m.dtype_bytes
    return full, full / s.delta_ratio


def host_rate(s: Setting) -> float:
    """Bytes/s one host moves to or from GCS: its link, or its parallel streams."""
    return min(s.host_gbps * GB / 8, s.pull_concurrency * s.stream_mb_s * 1e6)


def evaluate(s: Setting, m: Mode) -> dict:
    """Pure arithmetic: one row of the table."""
    full, delta = version_bytes(s, m)
    # A worker holding the previous version downloads one delta per step; full versions
    # carry a delta too, so only late joiners read full snapshots.
    per_version = delta if m.delta else full
    frac = s.host_fraction if m.shard_wise else 1.0
    host_bytes = per_version * frac
    hosts = s.inference_hosts
    versions_per_h = 3600.0 / s.step_s
    egress_per_h = versions_per_h * hosts * host_bytes
    host_bps = host_rate(s)
    quota_bps = s.egress_quota_gbps * GB / 8
    t_host = host_bytes / host_bps
    t_quota = hosts * host_bytes / quota_bps
    t_all = max(t_host, t_quota)
    range_b = s.range_mib * 2**20
    reads_per_host = math.ceil(host_bytes / range_b) + 2 + (s.full_every if m.delta else 0)
    # Requests per second while a version spreads (a burst under a second counts whole).
    reads_per_s = hosts * reads_per_host / max(t_all, 1.0) + hosts / s.poll_s
    shard_b = s.shard_mib * 2**20
    stored = full / s.full_every + delta if m.delta else full  # per version, on average
    writes_per_s = (math.ceil(stored / shard_b) + 2) / s.step_s  # shards, manifest, LATEST
    ramp_s = RAMP_DOUBLING_S * max(0.0, math.log2(reads_per_s / INITIAL_READS_PER_S))
    stale = math.ceil(t_all / s.step_s)
    limits = {
        "host link: time to pull > step": (
            t_host / s.step_s,
            f"pull_concurrency (now {s.pull_concurrency}, up to the host's link), shard-wise "
            f"pulls, deltas; or max_staleness >= {stale}",
        ),
        "egress quota: time to all hosts > step": (
            t_quota / s.step_s,
            f"fewer bytes (deltas, shard-wise pulls) or a raised egress quota; or "
            f"max_staleness >= {stale}",
        ),
        "reads/s > initial 5000": (
            reads_per_s / INITIAL_READS_PER_S,
            f"larger range reads (range_mib, now {s.range_mib}) or a gradual ramp-up",
        ),
        "writes/s > initial 1000": (
            writes_per_s / INITIAL_WRITES_PER_S,
            f"larger shards (shard_mib, now {s.shard_mib})",
        ),
        "LATEST writes > 1/s": (
            (1.0 / s.step_s) / SAME_OBJECT_WRITES_PER_S,
            "publish_every (one version per >= 1 s)",
        ),
    }
    worst = max(limits.items(), key=lambda kv: kv[1][0])
    return {
        "mode": m.name,
        "full_gb": full / GB,
        "version_gb": per_version / GB,
        "host_gb": host_bytes / GB,
        "egress_tb_per_h": egress_per_h / 1e12,
        "t_all_s": t_all,
        "t_host_s": t_host,
        "t_quota_s": t_quota,
        "reads_per_s": reads_per_s,
        "ramp_min": ramp_s / 60,
        "writes_per_s": writes_per_s,
        "latest_writes_per_s": 1.0 / s.step_s,
        "first_to_break": worst[0] if worst[1][0] >= 1 else f"nothing (closest: {worst[0]})",
        "margin": worst[1][0],
        "knob": worst[1][1],
    }


def measured_ratio(path: Path = MEASURED) -> float | None:
    """Median full bytes / median delta bytes of the RL benchmark, if it has run."""
    if not path.exists():
        return None
    rows = json.loads(path.read_text())["rows"]
    full = [r["full_bytes"] for r in rows if r.get("full_bytes")]
    delta = [r["delta_bytes"] for r in rows if r.get("delta_bytes")]
    return statistics.median(full) / statistics.median(delta) if full and delta else None


def table(s: Setting) -> str:
    rows = [evaluate(s, m) for m in MODES]
    out = [
        "| publishing | bytes/version (GB) | per host (GB) | egress (TB/h) | to all hosts (s) "
        f"vs step {s.step_s:.0f} s | reads/s (ramp-up) | writes/s | first to break (need/limit) "
        "| knob |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['mode']} | {r['version_gb']:.1f} | {r['host_gb']:.1f} | "
            f"{r['egress_tb_per_h']:.1f} | {r['t_all_s']:.1f} | {r['reads_per_s']:,.0f} "
            f"({r['ramp_min']:.0f} min) | {r['writes_per_s']:.1f} | {r['first_to_break']} "
            f"({r['margin']:.2f}x) | {r['knob']} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# The whole loop: a discrete-event simulation of the trainer, the parameter server and the
# rollout workers (docs/scale-model.md, *The whole loop*).

# TPU v5p, per chip (https://cloud.google.com/tpu/docs/v5p): bf16 peak, HBM2e capacity and
# bandwidth.
V5P_PEAK_FLOPS = 459e12
V5P_HBM_BYTES = 95e9
V5P_HBM_BPS = 2765e9

# The long tail benchmarks/results/engine.md measured (`100m` preset, float32, the
# `long-tail` workload of benchmarks/engine.py: 64 rows, up to 512 new tokens, EOS on):
# 2,283 tokens in 64 rows, median 27, max 158. An untrained model emits EOS with about the
# same probability at every step, so its lengths are geometric; the fit by the mean (35.7)
# has median 25 and an expected longest of 64 rows of 167 (measured: 27 and 158).
MEASURED_MEAN = 2283 / 64

# In-flight batches (`rollout.inflight_batches` > 1): off; only batches pinned to the
# version the engine holds (as tpu_jobs/generate/inflight.py builds it); any version (the
# variant: the engine holds two versions' weights and reads both while both have rows).
INFLIGHT = ("off", "same version", "any version")


@dataclass(frozen=True)
class Lengths:
    """A batch's completion lengths: resampled from `sample` (measured lengths, e.g. a
    run's rollout batches) or, without one, geometric (the shape of the measured long
    tail); scaled so that their mean before the cap is `mean`, each capped at `cap`
    (`rollout.max_new_tokens`: a row that reaches it is truncated there)."""

    mean: float = 8192.0
    cap: int = 32768
    sample: tuple[int, ...] = ()

    def draw(self, rng: random.Random, n: int) -> list[int]:
        if self.sample:
            scale = self.mean / statistics.fmean(self.sample)
            return [min(self.cap, max(1, round(rng.choice(self.sample) * scale))) for _ in range(n)]
        if self.mean <= 1:
            return [1] * n
        log_q = math.log1p(-1.0 / self.mean)  # geometric on 1, 2, ... with this mean
        return [min(self.cap, 1 + int(math.log(1.0 - rng.random()) / log_q)) for _ in range(n)]


@dataclass(frozen=True)
class Loop:
    """The loop's inputs: the parameter server's `Setting` and publishing `Mode`, the run's
    schedule, its batches and the replicas' and trainer's hardware (docs/scale-model.md
    gives each one's source or marks it as an assumption)."""

    ps: Setting = Setting()
    publishing: Mode = MODES[3]  # bfloat16 deltas, shard-wise pulls
    max_staleness: int = 0
    publish_every: int = 1
    inflight: str = "off"  # one of INFLIGHT
    inflight_batches: int = 2
    prompts_per_batch: int = 64
    group_size: int = 8
    prompt_tokens: int = 512
    lengths: Lengths = Lengths()
    trainer_mfu: float = 0.4
    decode_flops_eff: float = 0.5  # share of peak FLOP/s a decode step's matmuls reach
    decode_bw_eff: float = 0.8  # share of peak HBM bandwidth a decode step reaches
    hbm_usable: float = 0.9  # share of HBM for weights and KV (the rest: temporaries)
    slots: int = 0  # rows a replica decodes at once; 0: as many as fit, never preempted
    steps: int = 0  # trainer steps simulated; 0: `sim_steps` chooses
    seed: int = 0
    # QwQ-32B has Qwen2.5-32B's shape (tpu_jobs/learning/memory.py, QWEN25["32b"]).
    layers: int = 64
    heads: int = 40
    kv_heads: int = 8
    head_dim: int = 128

    def __post_init__(self) -> None:
        if self.inflight not in INFLIGHT:
            raise ValueError(f"inflight={self.inflight!r}; allowed: {', '.join(INFLIGHT)}")

    @property
    def workers(self) -> int:
        """Rollout workers: one per sampler replica on the inference chips."""
        return (self.ps.chips - self.ps.trainer_chips) // self.ps.sampler_tp

    @property
    def rows(self) -> int:
        return self.prompts_per_batch * self.group_size

    @property
    def weight_bytes(self) -> float:
        return self.ps.params * 2  # the sampler's bfloat16 weights

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bfloat16

    @property
    def replica_slots(self) -> int:
        """`slots`, or the rows whose whole KV (prompt + cap) fits beside the weights (two
        versions' weights for in-flight batches of any version): the engine's default
        `kv_token_budget`, with which no row is ever preempted."""
        if self.slots:
            return self.slots
        copies = 2 if self.inflight == "any version" else 1
        hbm = self.ps.sampler_tp * V5P_HBM_BYTES * self.hbm_usable - copies * self.weight_bytes
        row = self.kv_bytes_per_token * (self.prompt_tokens + self.lengths.cap)
        return max(1, int(hbm // row))

    @property
    def sim_steps(self) -> int:
        """Trainer steps to simulate: twice the window of claimable batches and at least 8
        `full_every` cycles, rounded so that the measured half holds whole cycles."""
        if self.steps:
            return self.steps
        cycle = 2 * self.ps.full_every
        want = max(4 * cycle, 2 * (self.max_staleness + 1) * self.publish_every)
        return -(-want // cycle) * cycle


def _linear_sum(a: float, b: float, lo: int, hi: int) -> float:
    """Sum of a + b k over the integers lo <= k < hi."""
    n = hi - lo
    return n * a + b * n * (lo + hi - 1) / 2 if n > 0 else 0.0


def _sum_of_max(a1: float, b1: float, a2: float, b2: float, m: int) -> float:
    """Sum over 0 <= k < m of max(a1 + b1 k, a2 + b2 k): each line's sum on its side of
    the crossing."""
    if b1 == b2:
        return _linear_sum(max(a1, a2), b1, 0, m)
    split = min(m, max(0, math.floor((a2 - a1) / (b1 - b2)) + 1))
    first, last = ((a2, b2), (a1, b1)) if b1 > b2 else ((a1, b1), (a2, b2))
    return _linear_sum(*first, 0, split) + _linear_sum(*last, split, m)


@dataclass(frozen=True)
class Roofline:
    """A replica's decode step as a roofline: the larger of its FLOPs over the replica's
    compute (matmuls 2 x params per row, attention 4 x layers x heads x head_dim per
    cached token) and its bytes over its HBM bandwidth (every weight once per version
    held, each cached token's keys and values), each at its share of peak. In seconds."""

    row_s: float  # matmul compute per live row
    attention_s: float  # attention compute per cached token
    weights_s: float  # reading one version's weights
    kv_s: float  # reading one cached token's keys and values

    @classmethod
    def of(cls, lp: Loop) -> Roofline:
        flops_s = lp.ps.sampler_tp * V5P_PEAK_FLOPS * lp.decode_flops_eff
        bytes_s = lp.ps.sampler_tp * V5P_HBM_BPS * lp.decode_bw_eff
        return cls(
            row_s=2 * lp.ps.params / flops_s,
            attention_s=4 * lp.layers * lp.heads * lp.head_dim / flops_s,
            weights_s=lp.weight_bytes / bytes_s,
            kv_s=lp.kv_bytes_per_token / bytes_s,
        )

    def seconds(self, steps: int, rows: int, context: int, copies: int = 1) -> float:
        """Time of `steps` decode steps with `rows` live rows holding `context` tokens in
        all at the first step; the context grows by `rows` a step, and both sides of the
        roofline with it, linearly."""
        if steps <= 0 or rows <= 0:
            return 0.0
        return _sum_of_max(
            self.row_s * rows + self.attention_s * context,
            self.attention_s * rows,
            self.weights_s * copies + self.kv_s * context,
            self.kv_s * rows,
            steps,
        )


def train_seconds(lp: Loop, tokens: int) -> float:
    """One trainer step: 6 x params FLOPs per token at `trainer_mfu` of the trainer chips."""
    return 6 * lp.ps.params * tokens / (lp.ps.trainer_chips * V5P_PEAK_FLOPS * lp.trainer_mfu)


def publish_seconds(lp: Loop, version: int) -> float:
    """The trainer's upload of `version` (it publishes before its next step): a full
    snapshot for v0, every `full_every`-th version a full one and its delta, otherwise a
    delta (full snapshots when the mode has no deltas), at one host's rate."""
    full, delta = version_bytes(lp.ps, lp.publishing)
    if not lp.publishing.delta or version == 0:
        stored = full
    else:
        stored = full + delta if version % lp.ps.full_every == 0 else delta
    return stored / host_rate(lp.ps)


def pull_cost(lp: Loop, held: int | None, version: int) -> tuple[float, float]:
    """(bytes through the project's egress, seconds on the hosts' links) for a replica
    holding `held` to get `version`: the deltas in between when `held` is at most one
    `full_every` cycle before the version's full snapshot (the anchor), else the anchor
    and the deltas after it (ParameterServer.pull's rule); shard-wise, each of the
    replica's hosts downloads its share at once."""
    full, delta = version_bytes(lp.ps, lp.publishing)
    if not lp.publishing.delta:
        size = full
    else:
        anchor = version - version % lp.ps.full_every
        if held is not None and anchor - lp.ps.full_every <= held < version:
            size = (version - held) * delta
        else:
            size = full + (version - anchor) * delta
    per_host = size * (lp.ps.host_fraction if lp.publishing.shard_wise else 1.0)
    hosts = max(1.0, lp.ps.sampler_tp / lp.ps.chips_per_host)
    return per_host * hosts, per_host / host_rate(lp.ps)


@dataclass
class _Replica:
    """One rollout worker: its engine's slots, the batches it holds, and where its slots'
    time went in the measured window."""

    ident: int
    slots: int
    loaded: int | None = None  # the newest version its weights hold
    pulling: int | None = None  # the batch whose version is on its way
    batches: list[int] = field(default_factory=list)  # claimed, oldest first
    queue: deque[tuple[int, int, int]] = field(default_factory=deque)  # (batch, version, length)
    # A heap of the live rows: (end step, admission step, batch, version).
    live: list[tuple[int, int, int, int]] = field(default_factory=list)
    left: dict[int, int] = field(default_factory=dict)  # batch -> rows not finished
    step: int = 0  # decode steps taken
    clock: float = 0.0  # the time at `step`
    admitted: int = 0  # sum over live rows of (admission step - prompt tokens)
    versions: Counter[int] = field(default_factory=Counter)  # live rows per version
    token: int = 0  # the current scheduled completion (older ones are stale)
    marked: float = 0.0
    use: Counter[str] = field(default_factory=Counter)  # slot-seconds by what they did

    def context(self) -> int:
        """Tokens the live rows hold: each its prompt and one per step since admission."""
        return len(self.live) * self.step - self.admitted


class _Simulation:
    """Trainer, egress and replicas as one event queue, in time order (heapq)."""

    def __init__(self, lp: Loop) -> None:
        self.lp = lp
        self.roofline = Roofline.of(lp)
        self.events: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.replicas = [_Replica(i, lp.replica_slots) for i in range(lp.workers)]
        self.lengths: dict[int, list[int]] = {}
        self.next_batch = 0  # the lowest batch no worker has claimed (claim_next's order)
        self.published = -1
        self.pipe_free = 0.0  # when the project's egress is next free (a FIFO pipe)
        self.quota = lp.ps.egress_quota_gbps * GB / 8
        self.step = 0  # the trainer's next batch
        self.busy = False
        self.ready: set[int] = set()
        self.total = lp.sim_steps
        self.start: float | None = None  # the measured window: the second half of the steps
        self.trainer_use: Counter[str] = Counter()
        self.trainer_state, self.trainer_marked = "publishing", 0.0  # v0

    # -- bookkeeping ----------------------------------------------------------------------
    def push(self, t: float, kind: str, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def _span(self, since: float, now: float) -> float:
        return 0.0 if self.start is None else max(0.0, now - max(since, self.start))

    def mark(self, r: _Replica, now: float) -> None:
        """Book the slots' time since the last mark under what they were doing."""
        dt = self._span(r.marked, now)
        r.marked = now
        if r.live:
            r.use["decoding"] += len(r.live) * dt
            r.use["tail"] += (r.slots - len(r.live)) * dt  # free slots, batches unfinished
        elif r.pulling is not None:
            r.use["pulling"] += r.slots * dt
        else:
            r.use["waiting"] += r.slots * dt  # no batch it may claim

    def mark_trainer(self, now: float, state: str) -> None:
        self.trainer_use[self.trainer_state] += self._span(self.trainer_marked, now)
        self.trainer_state, self.trainer_marked = state, now

    def version_of(self, batch: int) -> int:
        return required_version(batch, self.lp.publish_every, self.lp.max_staleness)

    # -- the trainer ----------------------------------------------------------------------
    def deliver(self, batch: int, now: float) -> None:
        self.ready.add(batch)
        self.train_next(now)

    def train_next(self, now: float) -> None:
        if self.busy or self.step not in self.ready or self.step >= self.total:
            return
        self.busy = True
        self.mark_trainer(now, "training")
        lengths = self.lengths[self.step]
        tokens = self.lp.rows * self.lp.prompt_tokens + sum(lengths)
        self.push(now + train_seconds(self.lp, tokens), "trained", self.step)

    def trained(self, step: int, now: float) -> None:
        if (step + 1) % self.lp.publish_every == 0:  # publish before the next step
            self.mark_trainer(now, "publishing")
            version = (step + 1) // self.lp.publish_every
            self.push(now + publish_seconds(self.lp, version), "published", step, version)
        else:
            self.stepped(step, now)

    def stepped(self, step: int, now: float) -> None:
        self.busy = False
        self.mark_trainer(now, "idle")
        self.step = step + 1
        if self.step == self.total // 2:
            self.start = now
        self.train_next(now)

    def publish(self, version: int, now: float) -> None:
        self.published = version
        for r in self.replicas:  # idle workers first: they claim a new batch at once
            if not r.batches:
                self.claim(r, now)
        for r in self.replicas:
            self.claim(r, now)

    # -- the workers ----------------------------------------------------------------------
    def claim(self, r: _Replica, now: float) -> None:
        """Claim the lowest unclaimed batch if its version is published: a worker with no
        batch always; one with batches in flight once all their rows are admitted and a
        slot is free, if its version is one the mode lets the engine take."""
        lp = self.lp
        if r.batches and (
            lp.inflight == "off"
            or len(r.batches) >= lp.inflight_batches
            or r.queue
            or r.pulling is not None
            or len(r.live) >= r.slots
        ):
            return
        batch = self.next_batch
        version = self.version_of(batch)
        if version > self.published:
            return
        if r.batches and lp.inflight == "same version" and version != r.loaded:
            return
        self.mark(r, now)
        self.next_batch += 1
        rng = random.Random(lp.seed * 1_000_003 + batch)  # a batch's rows, whoever makes it
        self.lengths[batch] = lp.lengths.draw(rng, lp.rows)
        r.batches.append(batch)
        r.left[batch] = lp.rows
        if version == r.loaded:
            self.feed(r, batch, now)
            return
        egress, link_s = pull_cost(lp, r.loaded, version)
        self.pipe_free = max(now, self.pipe_free) + egress / self.quota
        r.pulling = batch
        self.push(max(now + link_s, self.pipe_free), "pulled", r.ident, batch)

    def pulled(self, r: _Replica, batch: int, now: float) -> None:
        self.mark(r, now)
        r.pulling = None
        r.loaded = self.version_of(batch)
        self.feed(r, batch, now)

    def feed(self, r: _Replica, batch: int, now: float) -> None:
        """The batch's rows join the engine's queue and fill its free slots now."""
        self.advance(r, now)
        version = self.version_of(batch)
        r.queue.extend((batch, version, n) for n in self.lengths[batch])
        self.settle(r, now)

    def advance(self, r: _Replica, now: float) -> None:
        """Bring the engine to the first step boundary at or after `now` (rows are admitted
        between decode steps); with no live rows its clock simply jumps to `now`."""
        if not r.live:
            r.clock = now
            return
        n, ctx, copies = len(r.live), r.context(), len(r.versions)
        span = r.live[0][0] - r.step
        lo, hi = 0, span  # the fewest steps that reach `now`
        while lo < hi:
            mid = (lo + hi) // 2
            if r.clock + self.roofline.seconds(mid, n, ctx, copies) >= now:
                hi = mid
            else:
                lo = mid + 1
        r.clock += self.roofline.seconds(lo, n, ctx, copies)
        r.step += lo
        self.finish_rows(r)

    def finish_rows(self, r: _Replica) -> None:
        """Retire the rows that end at this step; a batch whose last row ended is written
        and the trainer may take it."""
        while r.live and r.live[0][0] <= r.step:
            _, admit, batch, version = heapq.heappop(r.live)
            r.admitted -= admit - self.lp.prompt_tokens
            r.versions[version] -= 1
            if not r.versions[version]:
                del r.versions[version]
            r.left[batch] -= 1
            if not r.left[batch]:
                del r.left[batch]
                r.batches.remove(batch)
                self.deliver(batch, r.clock)

    def settle(self, r: _Replica, now: float) -> None:
        """Admit queued rows into free slots, schedule the next row's end, then claim."""
        while r.queue and len(r.live) < r.slots:
            batch, version, length = r.queue.popleft()
            heapq.heappush(r.live, (r.step + length, r.step, batch, version))
            r.admitted += r.step - self.lp.prompt_tokens
            r.versions[version] += 1
        r.token += 1
        if r.live:
            t = r.clock + self.roofline.seconds(
                r.live[0][0] - r.step, len(r.live), r.context(), len(r.versions)
            )
            self.push(t, "rows", r.ident, r.token)
        self.claim(r, now)

    def rows_end(self, r: _Replica, token: int, now: float) -> None:
        if token != r.token:
            return  # rescheduled since
        self.mark(r, now)
        r.clock, r.step = now, r.live[0][0]
        self.finish_rows(r)
        self.settle(r, now)

    # -- the run --------------------------------------------------------------------------
    def run(self) -> dict:
        lp = self.lp
        self.push(publish_seconds(lp, 0), "published", -1, 0)  # v0: the base model
        while self.events:
            now, _, kind, a, b = heapq.heappop(self.events)
            if kind == "rows":
                self.rows_end(self.replicas[a], b, now)
            elif kind == "pulled":
                self.pulled(self.replicas[a], b, now)
            elif kind == "trained":
                self.trained(a, now)
            elif kind == "published":
                self.publish(b, now)
                if a >= 0:
                    self.stepped(a, now)
                else:
                    self.busy = False
                    self.mark_trainer(now, "idle")
                    self.train_next(now)
            if self.step >= self.total:
                return self.summary(now)
        raise RuntimeError("the simulation stalled")  # pragma: no cover

    def summary(self, end: float) -> dict:
        lp = self.lp
        for r in self.replicas:
            self.mark(r, end)
        self.mark_trainer(end, "idle")
        assert self.start is not None
        window = end - self.start
        first = self.total // 2
        batches = range(first, self.total)
        tokens = sum(lp.rows * lp.prompt_tokens + sum(self.lengths[i]) for i in batches)
        slot_s = sum(r.slots for r in self.replicas) * window
        use = sum((r.use for r in self.replicas), Counter())
        shares = {k: use[k] / slot_s for k in ("decoding", "tail", "pulling", "waiting")}
        trainer = {k: self.trainer_use[k] / window for k in ("training", "publishing", "idle")}
        return {
            "step_s": window / len(batches),
            "tokens_per_s": tokens / window,
            "generated_per_s": sum(sum(self.lengths[i]) for i in batches) / window,
            "trainer": trainer,
            "slots": shares,
            "limit": limit(lp, trainer, shares),
        }


def limit(lp: Loop, trainer: dict[str, float], slots: dict[str, float]) -> str:
    """What bounds the step: the trainer when it is hardly ever idle (its compute or its
    uploads, the larger), else what the replicas' slots spent most of their time on."""
    if trainer["idle"] < 0.1:
        uploads = trainer["publishing"] > trainer["training"]
        return "trainer: publishing" if uploads else "trainer compute"
    window = (lp.max_staleness + 1) * lp.publish_every
    names = {
        "waiting": f"window: {window} claimable batch{'es' * (window > 1)} for "
        f"{lp.workers} replicas",
        "pulling": "pulls",
        "tail": "generation tail",
        "decoding": "decode throughput",
    }
    return names[max(names, key=lambda k: slots[k])]


def simulate(lp: Loop) -> dict:
    """Run the loop for `lp.sim_steps` trainer steps (deterministic: lengths come from a
    seeded RNG per batch) and measure its second half: time per step, tokens trained per
    second, the trainer's time (training, publishing, idle) and the replicas' slot time
    (decoding, free in a batch's tail, pulling, waiting for a claimable batch), as shares."""
    return _Simulation(lp).run()


def loop_cases(base: Loop, staleness: Sequence[int] = (), knobs: bool = True) -> list[Loop]:
    """The loop table's rows: each `max_staleness` (default 0, 1, 2 and replicas - 1: every
    replica may hold a batch) in each in-flight mode; then two knobs past the limits those
    meet: upload/pull streams that fill a host's link, with the whole fleet's window, and
    `publish_every` = 2 x replicas (more batches of one version than replicas) with
    in-flight batches of the same version."""
    staleness = staleness or (0, 1, 2, base.workers - 1)
    rows = [replace(base, max_staleness=s, inflight=f) for s in staleness for f in INFLIGHT]
    if not knobs:
        return rows
    ps = base.ps
    streams = math.ceil(ps.host_gbps * GB / 8 / (ps.stream_mb_s * 1e6))
    fast = replace(base, ps=replace(ps, pull_concurrency=max(ps.pull_concurrency, streams)))
    w = base.workers
    rows += [replace(fast, max_staleness=w - 1, inflight=f) for f in ("off", "any version")]
    rows += [
        replace(fast, max_staleness=0, publish_every=2 * w, inflight=f)
        for f in ("off", "same version")
    ]
    return rows


def loop_table(cases: Sequence[Loop]) -> str:
    out = [
        "| max_staleness | publish_every | in-flight | streams | slots | time/step (s) "
        "| trained tok/s | trainer: training / publishing / idle | slots: decoding / tail / "
        "pulling / waiting | limit |",
        "|---:|---:|---|---:|---:|---:|---:|---|---|---|",
    ]
    for lp in cases:
        r = simulate(lp)
        t, sl = r["trainer"], r["slots"]
        out.append(
            f"| {lp.max_staleness} | {lp.publish_every} | {lp.inflight} | "
            f"{lp.ps.pull_concurrency} | {lp.replica_slots} "
            f"| {r['step_s']:,.1f} | {r['tokens_per_s']:,.0f} | {t['training']:.0%} / "
            f"{t['publishing']:.0%} / {t['idle']:.0%} | {sl['decoding']:.0%} / "
            f"{sl['tail']:.0%} / {sl['pulling']:.0%} / {sl['waiting']:.0%} | {r['limit']} |"
        )
    return "\n".join(out)


def read_lengths(path: Path) -> tuple[int, ...]:
    """Completion lengths from a file (integers separated by spaces, commas or lines, or
    a JSON list) or from a run's rollout batches (a directory of b*.parquet: the length of
    each row's completion_ids)."""
    if path.is_dir():
        import pyarrow.parquet as pq  # only for this input: the model needs no pyarrow

        files = sorted(path.glob("*.parquet"))
        return tuple(
            len(ids)
            for f in files
            for ids in pq.read_table(f, columns=["completion_ids"])["completion_ids"].to_pylist()
        )
    text = path.read_text().strip()
    values = json.loads(text) if text.startswith("[") else text.replace(",", " ").split()
    return tuple(int(v) for v in values)


LOOP_SWEPT = ("ps", "publishing", "lengths", "max_staleness", "inflight")  # not flags


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, value in vars(Setting()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    loop_flags = [f.name for f in fields(Loop) if f.name not in LOOP_SWEPT]
    for name in loop_flags:
        kind = type(getattr(Loop(), name))
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    parser.add_argument(
        "--staleness", help="max_staleness values of the loop table, e.g. 0,1,2,63 "
        "(default: 0, 1, 2 and replicas - 1)"
    )  # fmt: skip
    parser.add_argument(
        "--lengths", type=Path, help="measured completion lengths: a file of integers or a "
        "JSON list, or a run's rollouts/ directory of parquet batches (default: the "
        "geometric fit of benchmarks/results/engine.md's long tail)"
    )  # fmt: skip
    parser.add_argument(
        "--mean-new-tokens", type=float, help="scale the lengths to this mean before the "
        f"cap (default: {Lengths().mean:.0f} for the built-in shape, a file's own mean)"
    )  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=Lengths().cap)
    parser.add_argument("--no-knobs", action="store_true", help="only the --staleness rows")
    parser.add_argument("--part", choices=("both", "ps", "loop"), default="both")
    parser.add_argument("--out", type=Path, help="also write the printed tables here")
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    ps_given = {k: given[k] for k in vars(Setting()) if k in given}
    if "delta_ratio" not in ps_given:
        ratio = measured_ratio()
        if ratio is not None:
            ps_given["delta_ratio"] = ratio
    s = Setting(**ps_given)
    out: list[str] = []
    if args.part != "loop":
        out.append(
            f"{s.params / 1e9:.0f}B parameters; {s.chips} chips: {s.trainer_chips} trainer, "
            f"{s.inference_hosts} inference hosts of {s.chips_per_host} chips, sampler TP "
            f"{s.sampler_tp} (a host holds {s.host_fraction:.2f} of each weight); delta = full "
            f"/ {s.delta_ratio:.1f}; full every {s.full_every}; host link min("
            f"{s.host_gbps:.0f} Gb/s, {s.pull_concurrency} x {s.stream_mb_s:.0f} MB/s); "
            f"egress quota {s.egress_quota_gbps:.0f} Gb/s\n"
        )
        out.append(table(s) + "\n")
    if args.part != "ps":
        sample = read_lengths(args.lengths) if args.lengths else ()
        mean = args.mean_new_tokens or (statistics.fmean(sample) if sample else Lengths().mean)
        lengths = Lengths(mean=mean, cap=args.max_new_tokens, sample=sample)
        base = Loop(ps=s, lengths=lengths, **{k: given[k] for k in loop_flags if k in given})
        staleness = tuple(int(v) for v in args.staleness.split(",")) if args.staleness else ()
        shape = (
            f"resampled from {len(sample):,} lengths in {args.lengths}"
            if sample
            else "geometric (benchmarks/results/engine.md's long tail)"
        )
        out.append(
            f"Loop: {base.workers} replicas of {s.sampler_tp} chips; batches of "
            f"{base.prompts_per_batch} prompts x {base.group_size} = {base.rows} rows, "
            f"{base.prompt_tokens}-token prompts, completions {shape} scaled to mean "
            f"{lengths.mean:,.0f}, capped at {lengths.cap:,}; trainer {s.trainer_chips} "
            f"chips at {base.trainer_mfu:.0%} MFU; decode at {base.decode_flops_eff:.0%} of "
            f"peak FLOP/s and {base.decode_bw_eff:.0%} of HBM bandwidth; publishing "
            f"{base.publishing.name}; seed {base.seed}, the second half of each run's steps\n"
        )
        out.append(loop_table(loop_cases(base, staleness, knobs=not args.no_knobs)))
    text = "\n".join(out)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
