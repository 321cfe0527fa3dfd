"""Held-out evaluation of published weight versions.

    python -m tpu_jobs.evaluator --run RUN_URL [--version V | --version all | --version latest]
                                 [--follow]

For each version: n samples per held-out problem, scored by the task verifiers;
pass@k (unbiased estimator), maj@k and mean reward, each with a 95% bootstrap interval
over problems. Writes `eval/v{N:08d}.parquet` (one row per sample) create-only and a
summary record under `metrics/eval/`; a version already evaluated is skipped. Every
version is sampled with the same keys (common random numbers), so differences between
versions are not sampling noise of the keys.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.metrics import bootstrap_ci, maj_at_k, pass_at_k
from pipeline.paramserver import ParamServer
from pipeline.run import DONE_KEY, Run
from pipeline.tasks import get_task
from pipeline.tokenizer import get_tokenizer
from tpu_jobs.model import init_model, load_flat_params
from tpu_jobs.rollout_worker import sample_keys
from tpu_jobs.sampler import Sampler

EVAL_STREAM = 0xE7A1


def eval_key(version: int) -> str:
    return f"eval/v{version:08d}.parquet"


def summarise_samples(
    correct: np.ndarray,
    answers: list[list[str | None]],
    rewards: np.ndarray,
    ks,
    *,
    n_boot: int,
    seed: int,
) -> dict[str, dict[str, float]]:
    """correct/rewards: [problems, n]; answers: per problem, n extracted answers."""
    n = correct.shape[1]
    per_problem: dict[str, np.ndarray] = {"mean_reward": rewards.mean(axis=1)}
    c = correct.sum(axis=1)
    for k in ks:
        per_problem[f"pass@{k}"] = np.array([pass_at_k(n, int(ci), k) for ci in c])
        per_problem[f"maj@{k}"] = np.array(
            [
                float(maj_at_k(a[:k], list(cr[:k]), k))
                for a, cr in zip(answers, correct, strict=True)
            ]
        )
    out = {}
    for name, values in per_problem.items():
        mean, lo, hi = bootstrap_ci(values, n_boot=n_boot, seed=seed)
        out[name] = {"mean": float(mean), "lo": float(lo), "hi": float(hi)}
    return out


class Evaluator:
    def __init__(self, run: Run, *, log=print) -> None:
        self.run = run
        self.cfg = run.config
        self.log = log
        self.ps = ParamServer(run.store)
        self.tok = get_tokenizer("char")
        self.problems = run.read_problems("eval")[: self.cfg.eval.num_problems]
        self.model = init_model(self.cfg.model, self.cfg.seed)
        self.sampler = Sampler(self.cfg.model, pad_id=self.tok.pad_id, eos_id=self.tok.eos_id)

    def evaluate(self, version: int, *, server: ParamServer | None = None) -> dict[str, Any]:
        ec = self.cfg.eval
        if self.run.store.exists(f"metrics/eval/{version:08d}.json") and server is None:
            record = next(r for r in self.run.read_metrics("eval") if r["version"] == version)
            self.log(f"[eval] v{version} already evaluated; skipping")
            return record
        server = server or self.ps
        load_flat_params(self.model, server.pull(version).tensors)
        n = ec.num_samples
        t0 = time.time()
        rows = [(pi, s) for pi in range(len(self.problems)) for s in range(n)]
        keys = sample_keys(self.cfg.seed, EVAL_STREAM, 0, 0, len(self.problems), n)
        texts: list[str] = []
        lengths: list[int] = []
        for start in range(0, len(rows), ec.batch_size):
            chunk = rows[start : start + ec.batch_size]
            prompts = [self.tok.encode_prompt(self.problems[pi].prompt) for pi, _ in chunk]
            out = self.sampler.generate(
                self.model,
                prompts,
                keys[start : start + len(chunk)],
                max_new_tokens=self.cfg.sampler.max_new_tokens,
                temperature=ec.temperature,
            )
            for r in range(len(chunk)):
                ln = int(out.lengths[r])
                texts.append(self.tok.decode(out.tokens[r, :ln].tolist()))
                lengths.append(ln)
        rewards = np.zeros((len(self.problems), n), np.float32)
        answers: list[list[str | None]] = [[None] * n for _ in self.problems]
        for (pi, s), text in zip(rows, texts, strict=True):
            p = self.problems[pi]
            task = get_task(p.task)
            rewards[pi, s] = task.verify(p, text)
            answers[pi][s] = task.extract_answer(text)
        correct = rewards >= 1.0
        summary = summarise_samples(
            correct, answers, rewards, ec.ks, n_boot=ec.bootstrap, seed=self.cfg.seed
        )
        by_task: dict[str, list[int]] = defaultdict(list)
        for pi, p in enumerate(self.problems):
            by_task[p.task].append(pi)
        per_task = {
            t: summarise_samples(
                correct[ix],
                [answers[i] for i in ix],
                rewards[ix],
                ec.ks,
                n_boot=ec.bootstrap,
                seed=self.cfg.seed,
            )
            for t, ix in ((t, np.asarray(ix)) for t, ix in sorted(by_task.items()))
        }
        table = pa.table(
            {
                "version": np.full(len(rows), version, np.int64),
                "problem_id": [self.problems[pi].problem_id for pi, _ in rows],
                "task": [self.problems[pi].task for pi, _ in rows],
                "sample_index": np.asarray([s for _, s in rows], np.int32),
                "completion": texts,
                "answer": [answers[pi][s] for pi, s in rows],
                "reference": [self.problems[pi].answer for pi, _ in rows],
                "reward": rewards.reshape(-1),
                "num_tokens": np.asarray(lengths, np.int32),
            }
        )
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        record = {
            "version": version,
            "num_problems": len(self.problems),
            "num_samples": n,
            "metrics": summary,
            "per_task": per_task,
            "seconds": time.time() - t0,
        }
        if server is self.ps:
            self.run.store.write_new(eval_key(version), sink.getvalue())
            self.run.log_metrics("eval", version, record)
        self.log(format_summary(version, summary, time.time() - t0))
        return record


def format_summary(version: int | str, summary: dict[str, dict[str, float]], seconds: float) -> str:
    parts = [
        f"{name} {m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]" for name, m in summary.items()
    ]
    return f"[eval] v{version}: " + "  ".join(parts) + f"  ({seconds:.0f}s)"


def resolve_versions(ps: ParamServer, spec: str) -> list[int]:
    versions = ps.versions()
    if spec == "all":
        return versions
    if spec == "latest":
        return versions[-1:]
    try:
        wanted = [int(v) for v in spec.split(",")]
    except ValueError:
        raise SystemExit(
            f"--version {spec!r} is invalid; allowed: all, latest, or N[,N...]"
        ) from None
    missing = sorted(set(wanted) - set(versions))
    if missing:
        raise SystemExit(f"versions {missing} are not published; published: {versions}")
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_jobs.evaluator", description=__doc__)
    parser.add_argument("--run", required=True, help="run URL (directory or gs://bucket/prefix)")
    parser.add_argument("--version", default="all", help="all | latest | N[,N...]")
    parser.add_argument(
        "--every", type=int, default=1, help="with all: evaluate every Nth version (and the last)"
    )
    parser.add_argument(
        "--follow",
        action="store_true",
        help="keep evaluating new versions until the trainer is done",
    )
    args = parser.parse_args(argv)
    ev = Evaluator(Run.open(args.run), log=lambda m: print(m, flush=True))
    done: set[int] = set()
    while True:
        versions = resolve_versions(ev.ps, args.version)
        if args.version == "all" and args.every > 1:
            versions = [v for v in versions if v % args.every == 0 or v == versions[-1]]
        for v in versions:
            if v not in done:
                ev.evaluate(v)
                done.add(v)
        if not args.follow or ev.run.store.exists(DONE_KEY) and set(ev.ps.versions()) <= done:
            return 0
        time.sleep(2.0)


if __name__ == "__main__":
    sys.exit(main())
