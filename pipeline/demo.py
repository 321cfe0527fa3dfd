"""`rlax demo`: data -> SFT -> RL (trainer + N rollout workers as processes) -> eval -> report.

The roles are separate OS processes that meet only through the run directory (or
bucket); this module only starts them, follows their progress from the metrics they
write, and stops them. Re-running with the same --run resumes: every stage skips the
work whose output is already there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from pipeline import launcher
from pipeline.config import ConfigError
from pipeline.run import CONFIG_KEY, DONE_KEY, Run
from pipeline.storage import local_path, split_url
from pipeline.tasks.mix import build_splits


def write_data(run: Run) -> tuple[int, int]:
    """Generate the train/held-out problem sets (skipped if already there)."""
    if run.has_problems("train") and run.has_problems("eval"):
        return len(run.read_problems("train")), len(run.read_problems("eval"))
    try:
        train, held_out = build_splits(run.config.task)
    except ValueError as err:  # a task option its family cannot generate
        if run.store.list("") == [CONFIG_KEY]:  # just created: leave nothing behind
            run.store.delete(CONFIG_KEY)
        raise ConfigError(f"{err}; run {run.url} was not created") from None
    run.write_problems("eval", held_out)
    run.write_problems("train", train)
    return len(train), len(held_out)


def log_dir(run: Run) -> Path:
    """`{run}/logs` for a local run; for a remote run (nowhere to write files there) a folder
    under `.rlax-logs/` named for its URL: gs://b/runs/r1 -> `.rlax-logs/b_runs_r1`."""
    path = local_path(run.store.url)
    if path is not None:
        return path / "logs"
    parsed = split_url(run.store.url)
    return Path(".rlax-logs") / f"{parsed.bucket}/{parsed.key}".rstrip("/").replace("/", "_")


class JobFailed(RuntimeError):
    pass


@dataclass
class Fleet:
    """Processes of one stage; any non-zero exit fails the stage and stops the rest."""

    run: Run
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, role: str, extra: tuple[str, ...] = ()) -> None:
        path = log_dir(self.run) / f"{name}.log"
        self.procs[name] = launcher.start(role, self.run.url, extra, log_path=path)

    def check(self) -> None:
        for name, p in self.procs.items():
            code = p.poll()
            if code not in (None, 0):
                self.stop()
                tail = (log_dir(self.run) / f"{name}.log").read_text(errors="replace")[-3000:]
                raise JobFailed(f"{name} exited with code {code}; last output:\n{tail}")

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()


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


def run_demo(run: Run, workers: int, eval_every: int) -> str:
    cfg = run.config
    t_start = time.time()
    print(f"run: {run.url}\nlogs: {log_dir(run)}")

    n_train, n_eval = write_data(run)
    print(
        f"[1/5] data: {n_train} training and {n_eval} held-out problems "
        f"({', '.join(cfg.task.families)})"
    )

    until = f"until loss <= {cfg.sft.target_loss:g}, at most " if cfg.sft.target_loss > 0 else ""
    print(f"[2/5] SFT bootstrap on a noisy teacher ({until}{cfg.sft.steps} steps)")
    fleet = Fleet(run)
    fleet.start("sft", "sft")
    _follow(run, fleet, "sft", cfg.sft.steps, "sft", lambda: not fleet.alive("sft"), _loss_postfix)
    fleet.check()

    print(f"[3/5] RL: trainer + {workers} rollout workers as separate processes")
    fleet = Fleet(run)
    fleet.start("trainer", "train")
    for i in range(workers):
        fleet.start(f"worker{i}", "rollout", ("--worker-id", f"worker{i}"))
    try:
        _follow(
            run,
            fleet,
            "train",
            cfg.trainer.steps,
            "rl",
            lambda: run.store.exists(DONE_KEY) and not fleet.alive("trainer"),
            _reward_postfix,
        )
        fleet.check()
    finally:
        fleet.stop()

    if cfg.eval.orm:
        print("[3b/5] ORM baseline: an external verifier trained on the run's labelled rollouts")
        fleet = Fleet(run)
        fleet.start("orm", "orm")
        while fleet.alive("orm"):
            fleet.check()
            time.sleep(1.0)
        fleet.check()
        for line in (log_dir(run) / "orm.log").read_text().splitlines()[-3:]:
            print("  " + line)

    print("[4/5] held-out evaluation of published versions")
    fleet = Fleet(run)
    fleet.start("eval", "eval", ("--version", "all", "--every", str(eval_every)))
    while fleet.alive("eval"):
        fleet.check()
        time.sleep(1.0)
    fleet.check()
    for line in (log_dir(run) / "eval.log").read_text().splitlines():
        if line.startswith("[eval] v"):
            print("  " + line)

    print("[5/5] report")
    from pipeline.report import build_report

    md = build_report(run)
    print("\n" + md)
    print(f"\ndone in {time.time() - t_start:.0f}s; report: {run.url}/report/report.md")
    return md
