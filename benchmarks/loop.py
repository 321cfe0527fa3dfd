"""The whole RL loop: tokens trained per second and the trainer's and each rollout worker's
idle share, over max_staleness, publish_every, in-flight batches and the number of workers.

    nice -n 5 .venv/bin/python benchmarks/loop.py [--workers 1,2] [--staleness 0,1,2]
        [--publish-every 1,4] [--inflight 1,2] [--steps 20] [--warmup 2] [--no-prime]
        [--base runs/loop-.../base] [--out benchmarks/results/loop.md] [key=value ...]

One base is built first (configs/demo.yaml's data and its SFT'd model, `tests.runs.make_base`)
and every configuration is a clone of it (`tests.runs.clone_run`), so what each one measures
is RL only. A configuration is the RL stage of `rlax demo` (`pipeline.ops.demo.run_rl`): the
trainer and N rollout workers as separate processes meeting in the run directory, until
the trainer is done. Everything below is read back from the run's own files:

* the trainer's step records (`metrics/train/`): each carries the time it was written
  (`Run.log_metrics`, after the step) and `wait_s`, the time the step waited for its batch;
* the workers' batch records (`metrics/rollout/`): `seconds` from the batch's claim to its
  commit, `time` (the commit), `tokens`, `committed`, `worker_id`; a batch's busy interval
  is [time - seconds, time] (records from before `time` was written: the file's mtime).

The measured window is steady state. A configuration runs W + `--steps` trainer steps
and the window is the last `--steps`: from the end of step W to the end of the last step
(those steps fill it exactly). W is at least `--warmup` (the first steps pay the
processes' start, JAX's import, compiles and the first weight pull) and at least
(max_staleness + 1) * publish_every, the batches workers may make ahead of the trainer:
a trainer starts slower than a worker, so the workers fill that much before step 1, and
consuming it would flatter the trainer's throughput. Over the window: tokens trained/s =
the completion tokens of the batches its steps consumed / window; the trainer's idle
share = their summed `wait_s` / window; a worker's idle share = 1 - (the union of its
batches' busy intervals, clipped to the window) / window. Union, because with in-flight
batches a worker's batches overlap in time. A worker's "busy" includes pulling the weights
its batch is pinned to; "idle" is waiting for a claimable batch (one whose version is
published) and the time between a commit and the next claim.
"Made twice" counts batches generated but not committed (another worker committed first);
"dropped" the batches the trainer refused (stale or empty).

The machine's cores are shared by the trainer and every worker (and whatever else runs
on it), so the numbers are the loop's costs on this machine, not a scaling claim: two
workers on 2 cores contend with each other and with the trainer. Tokens/s follows the
machine's load (a shared machine moved it by up to 2.3x between identical loops); the
idle shares, ratios of one run's own times, are steadier. The table is rewritten after
each configuration, so a cut run keeps what it measured; raw numbers go to the .json
next to it. Cost on 2 shared cores: the base ~10 min (500 SFT steps; `--base` reuses
one), an untimed priming pass ~1 min, the default 24 configurations ~16 min.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import load_config  # noqa: E402
from pipeline.layout import worker_ids  # noqa: E402
from pipeline.paramserver import ParamServer  # noqa: E402
from pipeline.run import DONE_KEY, Run  # noqa: E402
from pipeline.storage import local_path  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "loop.md"
CONFIG = ROOT / "configs" / "demo.yaml"
# The base needs no held-out set (nothing is evaluated): a small one keeps it quick. A
# batch of 8 prompts x G=8 is the engine's 64 slots: a loop step costs seconds on 2 cores,
# and in-flight batches have room to matter (the next batch enters as rows finish).
BASE_OVERRIDES = ("task.num_eval=16", "eval.num_problems=16", "rollout.prompts_per_batch=8")


@dataclass(frozen=True)
class Setting:
    """One configuration of the loop."""

    workers: int
    staleness: int
    publish_every: int
    inflight: int

    def overrides(self, steps: int) -> list[str]:
        return [
            f"workers={self.workers}",
            f"trainer.max_staleness={self.staleness}",
            f"trainer.publish_every={self.publish_every}",
            f"rollout.inflight_batches={self.inflight}",
            f"trainer.steps={steps}",
        ]

    def warmup(self, least: int) -> int:
        """Steps left out of the window: at least `least` (start, compiles, first pulls),
        and at least the batches workers may make ahead of the trainer,
        (max_staleness + 1) * publish_every: the trainer's own start is slower than a
        worker's, so they fill that much before step 1, and the window starts once it is
        drained."""
        return max(least, (self.staleness + 1) * self.publish_every)

    def name(self) -> str:
        return f"w{self.workers}-s{self.staleness}-p{self.publish_every}-i{self.inflight}"


def grid(
    workers: Iterable[int],
    staleness: Iterable[int],
    publish_every: Iterable[int],
    inflight: Iterable[int],
) -> list[Setting]:
    """Every combination, max_staleness outermost: a run cut short still has every other
    dimension for the staleness values it reached."""
    return [
        Setting(w, s, p, i)
        for s, p, i, w in itertools.product(staleness, publish_every, inflight, workers)
    ]


# --------------------------------------------------------------------- pure measurement


def busy_seconds(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """The length of the union of `intervals` ([a, b] pairs) clipped to [start, end]:
    overlapping intervals (in-flight batches) count once."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals)
    total, reach = 0.0, start
    for a, b in clipped:
        a = max(a, reach)  # the part not counted yet
        if b <= a:  # outside the window, or inside what is already counted
            continue
        total += b - a
        reach = b
    return total


def measure(
    train: Sequence[dict], rollouts: Sequence[dict], workers: Sequence[str], warmup: int
) -> dict:
    """The window's numbers (module docstring) from the trainer's step records (`step`,
    `time`, `wait_s`, `step_s`, `batch_index`) and the workers' batch records (`worker_id`,
    `batch_index`, `tokens`, `committed`, `seconds`, and `end`: when it was written)."""
    steps = sorted(train, key=lambda r: r["step"])
    if len(steps) <= warmup:
        raise ValueError(f"{len(steps)} step records; need more than --warmup={warmup}")
    # The end of step `warmup`; with none, when step 1 began (its wait for batch 0 in).
    first = steps[0]["time"] - steps[0]["step_s"]
    start = steps[warmup - 1]["time"] if warmup else first
    end = steps[-1]["time"]
    window = steps[warmup:]
    span = end - start
    tokens_of = {r["batch_index"]: r["tokens"] for r in rollouts if r["committed"]}
    tokens = sum(tokens_of[r["batch_index"]] for r in window)
    idle = {}
    for w in workers:
        mine = [(r["end"] - r["seconds"], r["end"]) for r in rollouts if r["worker_id"] == w]
        idle[w] = 1.0 - busy_seconds(mine, start, end) / span
    return {
        "window_s": span,
        "window_steps": len(window),
        "tokens": tokens,
        "tokens_per_s": tokens / span,
        "trainer_idle": sum(r["wait_s"] for r in window) / span,
        "worker_idle": idle,
        "made_twice": sum(not r["committed"] for r in rollouts),
    }


# --------------------------------------------------------------------- reading a run


def rollout_records(run: Run) -> list[dict]:
    """The workers' batch records, each with `end`: when it was written. A record with a
    `time` of its own gives it; else (the records as the worker writes them today) the
    file's mtime, so a local run only."""
    root = local_path(run.url)
    out = []
    for key in run.store.list("metrics/rollout/"):
        record = json.loads(run.store.read(key))
        if "time" in record:
            record["end"] = record["time"]
        elif root is not None:
            record["end"] = os.stat(root / key).st_mtime
        else:
            raise SystemExit(f"{run.url}: rollout records carry no time; use a local run")
        out.append(record)
    return out


def run_setting(
    base: Run, url: str, s: Setting, args: argparse.Namespace, measured: int
) -> dict[str, object]:
    """Clone `base` to `url` with setting `s` (on top of `args.config` and
    `args.overrides`), run its RL stage for `s.warmup(args.warmup)` + `measured` steps and
    measure the last `measured`."""
    from pipeline.ops.demo import run_rl
    from tests.runs import clone_run

    warmup = s.warmup(args.warmup)
    steps = warmup + measured
    cfg = load_config(args.config, [*BASE_OVERRIDES, *args.overrides, *s.overrides(steps)])
    run = clone_run(base, url, cfg)
    print(f"=== {s.name()}: {run.url}", flush=True)
    t0 = time.monotonic()
    run_rl(run, s.workers)
    launch_s = time.monotonic() - t0
    done = json.loads(run.store.read(DONE_KEY))
    row = {
        **asdict(s),
        "steps": steps,
        "launch_to_done_s": launch_s,
        "dropped": done["dropped"],
        "run": run.url,
        **measure(run.read_metrics("train"), rollout_records(run), worker_ids(s.workers), warmup),
    }
    print(json.dumps(row, indent=1), flush=True)
    return row


# --------------------------------------------------------------------- report


def table(rows: list[dict]) -> list[str]:
    most = max((r["workers"] for r in rows), default=1)
    out = [
        "| workers | max_staleness | publish_every | inflight_batches | steps (measured) "
        "| RL wall s: window (launch to done) | tokens trained/s | trainer idle "
        + "".join(f"| worker{i} idle " for i in range(most))
        + "| made twice / dropped |",
        "|---" * (9 + most) + "|",
    ]
    for r in sorted(rows, key=_key):
        idle = [f"{v:.0%}" for v in r["worker_idle"].values()]
        idle += ["–"] * (most - len(idle))
        out.append(
            f"| {r['workers']} | {r['staleness']} | {r['publish_every']} | {r['inflight']} "
            f"| {r['steps']} ({r['window_steps']}) "
            f"| {r['window_s']:.1f} ({r['launch_to_done_s']:.0f}) | {r['tokens_per_s']:,.0f} "
            f"| {r['trainer_idle']:.0%} | "
            + " | ".join(idle)
            + f" | {r['made_twice']} / {r['dropped']} |"
        )
    return out


def _key(row: dict) -> tuple[int, ...]:
    return tuple(row[k] for k in ("workers", "staleness", "publish_every", "inflight"))


def write(out: Path, header: list[str], rows: list[dict], failed: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join([*header, "", *table(rows), "", *failed]) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=ints, default=[1, 2])
    parser.add_argument("--staleness", type=ints, default=[0, 1, 2])
    parser.add_argument("--publish-every", type=ints, default=[1, 4])
    parser.add_argument("--inflight", type=ints, default=[1, 2])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run")
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="steps left out before them: this many or (max_staleness + 1) * publish_every",
    )
    parser.add_argument(
        "--no-prime",
        dest="prime",
        action="store_false",
        help="skip the untimed first run that fills JAX's compilation cache",
    )
    parser.add_argument("--config", type=Path, default=CONFIG, help="the run config")
    parser.add_argument("--base", help="a base run to reuse (data + SFT'd model)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()

    import jax

    from benchmarks.demo_seeds import cpu_name
    from tests.runs import make_base

    load = os.getloadavg()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = ROOT / "runs" / f"loop-{stamp}"
    if args.base:
        base = Run.open(args.base)
    else:
        t0 = time.monotonic()
        base = make_base(
            str(root / "base"), load_config(args.config, [*BASE_OVERRIDES, *args.overrides])
        )
        print(f"base built in {time.monotonic() - t0:.0f}s: {base.url}", flush=True)
    settings = grid(args.workers, args.staleness, args.publish_every, args.inflight)
    if args.prime:
        # The engine compiles a program per shape bucket it meets, once per machine (the
        # launcher's persistent cache): without this the first configuration pays them all.
        t0 = time.monotonic()
        for s in dict.fromkeys([Setting(1, 0, 1, 1), Setting(1, 0, 4, max(args.inflight))]):
            run_setting(base, str(root / f"prime-{s.name()}"), s, args, 4)
        print(f"primed in {time.monotonic() - t0:.0f}s", flush=True)
    cfg = load_config(args.config, [*BASE_OVERRIDES, *args.overrides])
    sft = ParamServer(base.store.child("base")).manifest(0).get("metadata", {})
    header = [
        "# The whole RL loop: tokens trained/s and idle shares",
        "",
        f"`nice -n 5 .venv/bin/python {' '.join(sys.argv)}` on {time.strftime('%Y-%m-%d')}: "
        f"{cpu_name()}, {os.cpu_count()} cores, {platform.machine()}, JAX {jax.__version__}; "
        f"load average before the run {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        "(the machine is shared with other jobs).",
        "",
        f"Size: {os.path.relpath(args.config, ROOT)} (`{cfg.model.preset}` preset, "
        f"{cfg.rollout.prompts_per_batch} prompts x G={cfg.rollout.group_size} per batch, "
        f"up to {cfg.sampler.max_new_tokens} new tokens, {cfg.trainer.algorithm}) from its SFT'd "
        f"base ({base.url}, {sft.get('steps')} SFT steps). Each configuration runs W + "
        f"{args.steps} trainer steps and measures the last "
        f"{args.steps}: W = max({args.warmup}, (max_staleness + 1) x publish_every) "
        "(benchmarks/loop.py's docstring has the method"
        + ("" if args.prime else "; no priming run: the first row paid the compiles")
        + "). "
        "Trainer and workers share the machine's cores: these are the loop's costs here, "
        "not a scaling claim.",
    ]
    rows: list[dict] = []
    failed: list[str] = []
    for s in settings:
        try:
            rows.append(run_setting(base, str(root / s.name()), s, args, args.steps))
        except Exception as exc:  # a failed configuration is reported, the rest still run
            print(f"=== {s.name()} failed: {exc!r}", flush=True)
            failed.append(f"- {s.name()} failed: {exc!r}")
        write(args.out, header, rows, failed)
    print("\n".join(table(rows)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
