"""`rlax demo`: data -> SFT -> RL (trainer + N rollout workers as processes) -> eval -> report.

The roles are separate OS processes that meet only through the run directory (or
bucket); this module only starts them, follows their progress from the metrics they
write, and stops them. Re-running with the same --run resumes: every stage skips the
work whose output is already there.
"""

from __future__ import annotations

import json
import sys
import time

from tqdm import tqdm

from pipeline.layout import worker_ids
from pipeline.ops.launcher import Fleet
from pipeline.problem_sets import write_data
from pipeline.run import DONE_KEY, Run


def _follow(run: Run, fleet: Fleet, stream: str, total: int, desc: str, until, postfix=None):
    """Show a progress bar driven by the metric records (their index is the step)."""
    bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=sys.stdout)
    last = None
    try:
        while True:
            fleet.check()
            keys = list(run.iter_metric_keys(stream))
            if keys and keys[-1] != last:
                last = keys[-1]
                bar.update(int(last.rsplit("/", 1)[-1].split(".")[0]) - bar.n)
                if postfix is not None:
                    bar.set_postfix_str(postfix(run, last))
            if until():
                break
            time.sleep(1.0)
    finally:
        bar.close()


def _reward_postfix(run: Run, key: str) -> str:
    return f"reward {json.loads(run.store.read(key))['reward_mean']:.3f}"


def _loss_postfix(run: Run, key: str) -> str:
    return f"loss {json.loads(run.store.read(key))['loss']:.3f}"


def run_rl(run: Run, workers: int) -> None:
    """The RL stage: the trainer and `workers` rollout workers as processes, followed until
    the trainer is done; then the workers are stopped (benchmarks/loop.py times this)."""
    fleet = Fleet(run.url)
    fleet.start("trainer", "train")
    for name in worker_ids(workers):
        fleet.start(name, "rollout", ("--worker-id", name))
    try:
        _follow(
            run,
            fleet,
            "train",
            run.config.trainer.steps,
            "rl",
            lambda: run.store.exists(DONE_KEY) and not fleet.alive("trainer"),
            _reward_postfix,
        )
        fleet.check()
    finally:
        fleet.stop()


def run_demo(run: Run, workers: int, eval_every: int) -> str:
    cfg = run.config
    t_start = time.time()
    fleet = Fleet(run.url)
    print(f"run: {run.url}\nlogs: {fleet.log_dir}")

    n_train, n_eval = write_data(run)
    print(
        f"[1/5] data: {n_train} training and {n_eval} held-out problems "
        f"({', '.join(cfg.task.families)})"
    )

    until = f"until loss <= {cfg.sft.target_loss:g}, at most " if cfg.sft.target_loss > 0 else ""
    print(f"[2/5] SFT bootstrap on a noisy teacher ({until}{cfg.sft.steps} steps)")
    fleet.start("sft", "sft")
    _follow(run, fleet, "sft", cfg.sft.steps, "sft", lambda: not fleet.alive("sft"), _loss_postfix)
    fleet.check()

    print(f"[3/5] RL: trainer + {workers} rollout workers as separate processes")
    run_rl(run, workers)

    if cfg.eval.orm:
        print("[3b/5] ORM baseline: an external verifier trained on the run's labelled rollouts")
        fleet = Fleet(run.url)
        fleet.start("orm", "orm")
        fleet.wait("orm")
        for line in fleet.log_path("orm").read_text().splitlines()[-3:]:
            print("  " + line)

    print("[4/5] held-out evaluation of published versions")
    fleet = Fleet(run.url)
    fleet.start("eval", "eval", ("--version", "all", "--every", str(eval_every)))
    fleet.wait("eval")
    for line in fleet.log_path("eval").read_text().splitlines():
        if line.startswith(("[eval] v", "[eval] teacher")):
            print("  " + line)

    print("[5/5] report")
    from pipeline.report import build_report

    md = build_report(run)
    print("\n" + md)
    print(f"\ndone in {time.time() - t_start:.0f}s; report: {run.url}/report/report.md")
    return md
