"""The parameter server at RLAX's scale: a cost model (docs/scale-model.md explains it).

For the seeds' setting (a 32B model, 1,024 TPU v5p chips split between the trainer and
inference hosts, a new version every step) it prints, per way of publishing: the bytes per
version, what each inference host downloads, the aggregate GCS egress per hour, the time to
get a version to every host against the step time, the request rates against GCS's
published limits, and what breaks first with the knob that fixes it.

The delta size comes from the measured ratio of benchmarks/results/paramserver_deltas.json
(a real RL run publishing bfloat16 versions) unless `--delta-ratio` is given. Everything
else is an argument whose default is stated in docs/scale-model.md, with its source or
marked as an assumption.

    .venv/bin/python benchmarks/scale_model.py [--params 32e9] [--step-s 60] ...
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

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


def evaluate(s: Setting, m: Mode) -> dict:
    """Pure arithmetic: one row of the table."""
    full = s.params * m.dtype_bytes
    delta = full / s.delta_ratio
    # A worker holding the previous version downloads one delta per step; full versions
    # carry a delta too, so only late joiners read full snapshots.
    per_version = delta if m.delta else full
    frac = s.host_fraction if m.shard_wise else 1.0
    host_bytes = per_version * frac
    hosts = s.inference_hosts
    versions_per_h = 3600.0 / s.step_s
    egress_per_h = versions_per_h * hosts * host_bytes
    host_bps = min(s.host_gbps * GB / 8, s.pull_concurrency * s.stream_mb_s * 1e6)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    defaults = Setting()
    for name, value in vars(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    if "delta_ratio" not in given:
        ratio = measured_ratio()
        if ratio is not None:
            given["delta_ratio"] = ratio
    s = Setting(**given)
    print(
        f"{s.params / 1e9:.0f}B parameters; {s.chips} chips: {s.trainer_chips} trainer, "
        f"{s.inference_hosts} inference hosts of {s.chips_per_host} chips, sampler TP "
        f"{s.sampler_tp} (a host holds {s.host_fraction:.2f} of each weight); delta = full / "
        f"{s.delta_ratio:.1f}; full every {s.full_every}; host link min({s.host_gbps:.0f} Gb/s, "
        f"{s.pull_concurrency} x {s.stream_mb_s:.0f} MB/s); egress quota "
        f"{s.egress_quota_gbps:.0f} Gb/s\n"
    )
    print(table(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
