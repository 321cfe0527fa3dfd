"""Held-out evaluation of published weight versions.

    python -m tpu_jobs.evaluator --run RUN_URL [--version V | --version all | --version latest]
                                 [--k 1,4,8,16,32] [--every N] [--follow]
                                 [--dataset humaneval]

For each version: n samples per held-out problem, scored by the task verifiers;
pass@k (unbiased estimator), maj@k and mean reward, each with a 95% bootstrap interval
over problems. With `eval.self_prm` (default) every sample is also judged by the
evaluated version itself (`tpu_jobs.model.judge.self_scores`: p(y) / (p(y) + p(n)) after the
judge suffix), giving self_prm@k (best of the first k by self-score), judge_accuracy,
judge_auc, judge_auc_within (the AUC among one problem's samples, averaged over problems
with both outcomes: what reranking needs) and the judge's precision / recall by
difficulty tercile; when the run has an ORM (`tpu_jobs/orm.py`, `orm/` parameter server)
its scores give orm@k, orm_accuracy, orm_auc and orm_auc_within the same way. With
`eval.self_conf` (default "mean") every sample is also ranked by its own tokens' log-probs
under the evaluated version, as the sampler returned them (`pipeline.metrics.self_confidence`):
self_conf@k, self_conf_vs_maj@k, conf_auc and conf_auc_within. docs/evaluation.md defines
every metric.

Writes `eval/v{N:08d}.parquet` (one row per sample) create-only and a summary record
under `metrics/eval/`; a version already evaluated is skipped. Every version is sampled
with the same keys (common random numbers), so differences between versions are not
sampling noise of the keys; the key of sample s of problem p does not depend on n, so
the first n samples of a larger evaluation are those of a smaller one. Prompts are encoded
with the run's tokenizer (`model.tokenizer`); `mesh.sampler` samples on a device mesh.

`--k` overrides `eval.ks`; n becomes max(eval.num_samples, max k). Records are
immutable, so an evaluation whose (n, ks) differs from the config's goes to its own
keys: samples `eval/v{N:08d}-n{n}.parquet` (when n differs) and the record in stream
`metrics/eval-n{n}-k{k1}_{k2}.../` (`eval_stream`). Each (version, n, ks) is evaluated
once; if the samples for (version, n) already exist, a new ks only re-summarises them.

`--dataset NAME` evaluates on a built-in set (`pipeline.tasks.datasets.DATASETS`, e.g.
HumanEval's 164 problems, scored by the sandboxed code verifier) instead of the run's
held-out problems, all of them (`eval.num_problems` caps only the held-out set). Its
samples and records get keys of their own: `eval/v{N:08d}-{NAME}[-n{n}].parquet` and the
stream `eval-{NAME}[-n{n}-k...]`.

A run with a teacher (`distill.teacher`, on-policy distillation) also evaluates its pinned
teacher once, before the versions (`Evaluator.evaluate_teacher`; it pins the teacher if no
job has): the same problems, keys and metrics, with the teacher's own model shape, into
`eval/teacher[-{NAME}][-n{n}].parquet` and the stream `teacher-{stream}` (index 0). The
report sets every version against it (docs/evaluation.md, "The teacher").
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.layout import TEACHER_EVAL, eval_key, eval_stream, teacher_stream
from pipeline.metrics import (
    best_of_k,
    bootstrap_auc,
    bootstrap_ci,
    judge_stats,
    judge_stats_by_bucket,
    maj_at_k,
    pass_at_k,
    self_confidence,
    tool_use_stats,
    within_problem_auc,
)
from pipeline.paramserver import ParamServer, Snapshot
from pipeline.paramserver.adapters import PolicyReader
from pipeline.parquet_bytes import table_from_bytes, table_to_bytes
from pipeline.run import DONE_KEY, Run, base_server, policy_reader
from pipeline.tasks import get_task
from pipeline.tasks.datasets import DATASETS, load_dataset
from pipeline.teacher import check_copy, pin_teacher, teacher_config
from tpu_jobs.generate.episodes import sample_rows
from tpu_jobs.generate.interface import sampling_params
from tpu_jobs.generate.policy import Policy, load_policy
from tpu_jobs.generate.sample_verify import EVAL_STREAM, sample_keys
from tpu_jobs.model.judge import load_orm, self_scores

JUDGE_THRESHOLD = 0.5  # a judge says "correct" when its score p(y)/(p(y)+p(n)) > this


@dataclass(frozen=True)
class Scorer:
    """A reranker of an evaluation's samples: its per-sample score `column` in the samples
    table and the `prefix` of its AUC metrics ({prefix}_auc, {prefix}_auc_within). A
    `verdict` score is a probability that the sample is right, so it also has an accuracy
    at `JUDGE_THRESHOLD` and a judge report; a confidence (a log-prob) only ranks."""

    column: str
    prefix: str
    verdict: bool


# Rerankers: metric prefix ({name}@k, {name}_vs_maj@k) -> its Scorer.
SCORERS = {
    "self_prm": Scorer("self_score", "judge", verdict=True),
    "orm": Scorer("orm_score", "orm", verdict=True),
    "self_conf": Scorer("conf_score", "conf", verdict=False),
}
DIFFICULTY_NOTE = (
    "difficulty = the problem's pass rate over its n samples at the evaluated version; "
    "problems sorted by it (ties by problem order) and split by rank into terciles "
    "hard / medium / easy"
)


def parse_ks(spec: str) -> tuple[int, ...]:
    try:
        ks = sorted({int(k) for k in spec.split(",") if k.strip()})
    except ValueError:
        ks = []
    if not ks or ks[0] < 1:
        raise SystemExit(f"--k {spec!r} is invalid; allowed: positive integers, e.g. 1,4,8,16,32")
    return tuple(ks)


def summarise_samples(
    correct: np.ndarray,
    answers: list[list[str | None]],
    rewards: np.ndarray,
    ks,
    *,
    n_boot: int,
    seed: int,
    scores: dict[str, np.ndarray] | None = None,
) -> dict[str, dict[str, float]]:
    """correct/rewards: [problems, n]; answers: per problem, n extracted answers; scores:
    {SCORERS key: [problems, n]} (e.g. {"self_prm": self-scores}) for best-of-k reranking
    (`{name}@k`: the highest-scored of the first k samples, ties to the earliest), its
    paired difference with maj@k (`{name}_vs_maj@k`), and the judge's accuracy (verdict =
    score > 0.5), AUC and within-problem AUC against the verifier."""
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
    for name, s in (scores or {}).items():
        for k in ks:
            per_problem[f"{name}@{k}"] = np.array(
                [float(best_of_k(si, ci, k)) for si, ci in zip(s, correct, strict=True)]
            )
            # Paired per problem: its interval says whether reranking beats the vote.
            per_problem[f"{name}_vs_maj@{k}"] = per_problem[f"{name}@{k}"] - per_problem[f"maj@{k}"]
    for name, s in (scores or {}).items():
        if SCORERS[name].verdict:
            # Every problem has n samples, so the mean of per-problem accuracies is the accuracy.
            accuracy = ((s > JUDGE_THRESHOLD) == correct).mean(1)
            per_problem[f"{SCORERS[name].prefix}_accuracy"] = accuracy

    def interval(values: np.ndarray) -> dict[str, float]:
        mean, lo, hi = bootstrap_ci(values, n_boot=n_boot, seed=seed)
        return {"mean": float(mean), "lo": float(lo), "hi": float(hi)}

    out = {name: interval(values) for name, values in per_problem.items()}
    for name, s in (scores or {}).items():
        auc = bootstrap_auc(s, correct, n_boot=n_boot, seed=seed)
        if auc is not None:
            out[f"{SCORERS[name].prefix}_auc"] = dict(zip(("mean", "lo", "hi"), auc, strict=True))
        within = within_problem_auc(s, correct)  # one value per problem with both outcomes
        if len(within):
            out[f"{SCORERS[name].prefix}_auc_within"] = interval(within)
    return out


def judge_report(scores: dict[str, np.ndarray], correct: np.ndarray) -> dict[str, Any]:
    """{SCORERS key: {"overall": judge_stats, "by_difficulty": {hard|medium|easy: stats}}}
    for the verdict scorers (a confidence has no verdict to count)."""
    return {
        name: {
            "overall": judge_stats(s, correct, JUDGE_THRESHOLD),
            "by_difficulty": judge_stats_by_bucket(s, correct, JUDGE_THRESHOLD),
        }
        for name, s in scores.items()
        if SCORERS[name].verdict
    }


class Evaluator:
    """`mesh`: the sampler's device mesh; None takes `mesh.sampler` of the run config
    (None there too: one device). `dataset`: a built-in set (`DATASETS`) to evaluate on
    instead of the run's held-out problems."""

    def __init__(
        self, run: Run, *, ks=None, log=print, mesh: Any = None, dataset: str | None = None
    ) -> None:
        self.run = run
        self.cfg = run.config
        self.log = log
        # A LoRA run's versions are adapters, merged into its base once per version.
        self.reader = policy_reader(run)
        self.ps = self.reader.ps
        self.policy = load_policy(run, "eval", mesh=mesh)
        self.tok, self.model, self.sampler = self.policy.tok, self.policy.model, self.policy.sampler
        self.mesh = self.policy.mesh
        self.dataset = dataset
        if dataset is None:
            self.problems = run.read_problems("eval")[: self.cfg.eval.num_problems]
        else:
            self.problems = load_dataset(dataset)
        ec = self.cfg.eval
        self.ks = tuple(sorted({int(k) for k in ks})) if ks else tuple(ec.ks)
        self.n = max(ec.num_samples, max(self.ks))
        self.stream = eval_stream(self.n, self.ks, ec.num_samples, ec.ks, dataset)
        self._orm: tuple[Any, dict[str, Any]] | None = None

    def samples_key(self, version: int) -> str:
        return eval_key(version, self.n, self.cfg.eval.num_samples, self.dataset)

    def record_key(self, version: int, stream: str | None = None) -> str:
        return f"metrics/{stream or self.stream}/{version:08d}.json"

    def orm(self) -> tuple[Any, dict[str, Any]] | None:
        """The run's ORM (model, metadata) once it is published; None before."""
        if self._orm is None:
            self._orm = load_orm(self.run)
        return self._orm

    def evaluate(self, version: int, *, server: ParamServer | None = None) -> dict[str, Any]:
        """Evaluate `version` of the run (or of `server`, whose results are not kept)."""
        server = server or self.ps
        own = server is self.ps  # results of the run's own versions are kept

        def policy() -> Policy:
            reader = self.reader if own else PolicyReader(server, base_server(self.run))
            self.policy.load(reader.pull(version))
            return self.policy

        return self._evaluate(
            version,
            f"v{version}",
            policy,
            samples_key=self.samples_key(version) if own else None,
            stream=self.stream if own else None,
        )

    def evaluate_teacher(self) -> dict[str, Any]:
        """Evaluate the run's pinned teacher (on-policy distillation; pinned here if no job
        of the run has pinned it yet) as a version is evaluated: the same problems, sample
        keys and metrics, so the report can set each version against it (its gap to the
        teacher, paired per problem). Its samples go to `eval/teacher[...].parquet`, its
        record to `metrics/teacher-{stream}/00000000.json`, both create-only: done once
        per (n, ks, dataset), a retry skips it. Its `version` column and field is 0, the
        teacher's version on the run's teacher server; `teacher` says which snapshot it is."""
        pin = pin_teacher(self.run, owner="evaluator")

        def policy() -> Policy:
            # The teacher's own shape (its run's model section), loaded only to sample: a
            # retry that finds the samples needs no second model in memory. The copy is
            # verified against the pin as it is read (once).
            return load_policy(
                self.run,
                "eval",
                snapshot=Snapshot.of(0, check_copy(self.run, pin)),
                mesh=self.mesh,
                model=teacher_config(self.run).model,
            )

        identity = {**dataclasses.asdict(pin), "requested": self.cfg.distill.teacher_version}
        return self._evaluate(
            0,
            TEACHER_EVAL,
            policy,
            samples_key=eval_key(TEACHER_EVAL, self.n, self.cfg.eval.num_samples, self.dataset),
            stream=teacher_stream(self.stream),
            extra={"teacher": identity},
        )

    def _evaluate(
        self,
        version: int,
        label: str,
        policy: Callable[[], Policy],
        *,
        samples_key: str | None,
        stream: str | None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Sample, score and summarise `policy()` (called only when it must sample) as
        `version`; with `samples_key` and `stream`, the samples and the record are kept
        (create-only) and found again by a retry, which then skips the work."""
        if stream is not None and self.run.store.exists(self.record_key(version, stream)):
            record = next(r for r in self.run.read_metrics(stream) if r["version"] == version)
            self.log(f"[eval] {label} already evaluated ({stream}); skipping")
            return record
        t0 = time.time()
        if samples_key is not None and self.run.store.exists(samples_key):
            # Same samples, other ks: re-summarise the stored rows, no sampling.
            table = table_from_bytes(self.run.store.read(samples_key))
            self.log(f"[eval] {label}: summarising stored {samples_key}")
        else:
            table = self._sample_and_score(version, policy())
            if samples_key is not None:
                self.run.store.write_new(samples_key, table_to_bytes(table))
        record = {**self.summarise_table(version, table), **(extra or {})}
        record["seconds"] = time.time() - t0
        if stream is not None:
            self.run.log_metrics(stream, version, record)
        self.log(format_summary(label, record["metrics"], time.time() - t0))
        return record

    def _sample_and_score(self, version: int, policy: Policy) -> pa.Table:
        ec = self.cfg.eval
        n = self.n
        rows = [(pi, s) for pi in range(len(self.problems)) for s in range(n)]
        keys = sample_keys(self.cfg.seed, EVAL_STREAM, 0, 0, len(self.problems), n)
        problems = [self.problems[pi] for pi, _ in rows]
        scored = sample_rows(  # tool episodes when the run sets an environment
            policy.sampler,
            policy.model,
            self.tok,
            self.cfg.environment,
            problems,
            keys,
            # eval.temperature, without top-k / top-p: the evaluator's policy
            # (tpu_jobs.generate.interface, docs/evaluation.md "Sampling settings").
            sampling_params(self.cfg, "eval"),
            batch_size=ec.batch_size,
        )
        texts, completion_ids = scored.texts, scored.completion_ids
        rewards = scored.rewards.reshape(len(self.problems), n)
        answers: list[list[str | None]] = [[None] * n for _ in self.problems]
        # The verifier's reading: a tool episode's answer is in its last turn.
        answer_texts = scored.final_texts or texts
        for (pi, s), text in zip(rows, answer_texts, strict=True):
            answers[pi][s] = get_task(self.problems[pi].task).extract_answer(text)
        columns: dict[str, Any] = {
            "version": np.full(len(rows), version, np.int64),
            "problem_id": [self.problems[pi].problem_id for pi, _ in rows],
            "task": [self.problems[pi].task for pi, _ in rows],
            "sample_index": np.asarray([s for _, s in rows], np.int32),
            "completion": texts,
            "answer": [answers[pi][s] for pi, s in rows],
            "reference": [self.problems[pi].answer for pi, _ in rows],
            "reward": rewards.reshape(-1),
            "num_tokens": scored.lengths,
        }
        if scored.turns is not None:  # tool episodes
            columns["turns"] = np.asarray(scored.turns, np.int32)
            columns["tool_calls"] = np.asarray(scored.tool_calls, np.int32)
            columns["tool_errors"] = pa.array(scored.tool_errors, pa.list_(pa.string()))
        judged_prompts = scored.prompt_ids
        if ec.self_prm:  # the evaluated version judges its own samples
            columns["self_score"] = self_scores(
                policy.model, self.tok, judged_prompts, completion_ids, batch_size=ec.batch_size
            )
        if ec.self_conf != "none":  # free: the sampler's log-probs of the sample's own tokens
            columns["conf_score"] = self_confidence(
                scored.logprobs, ec.self_conf, scored.loss_masks
            )
        orm = self.orm()
        if orm is not None:
            columns["orm_score"] = self_scores(
                orm[0], self.tok, judged_prompts, completion_ids, batch_size=ec.batch_size
            )
        return pa.table(columns)

    def summarise_table(self, version: int, table: pa.Table) -> dict[str, Any]:
        """The metrics record of one version from its per-sample table (rows ordered by
        problem, then sample index, as `_sample_and_score` writes them)."""
        ec = self.cfg.eval
        cols = table.to_pydict()
        n = int(max(cols["sample_index"])) + 1
        p = len(cols["problem_id"]) // n
        rewards = np.asarray(cols["reward"], np.float32).reshape(p, n)
        answers = [cols["answer"][i * n : (i + 1) * n] for i in range(p)]
        correct = rewards >= 1.0
        scores = {
            name: np.asarray(cols[scorer.column], np.float64).reshape(p, n)
            for name, scorer in SCORERS.items()
            if scorer.column in cols
        }
        tasks = [cols["task"][i * n] for i in range(p)]

        def summary(ix):
            return summarise_samples(
                correct[ix],
                [answers[i] for i in ix],
                rewards[ix],
                self.ks,
                n_boot=ec.bootstrap,
                seed=self.cfg.seed,
                scores={name: s[ix] for name, s in scores.items()},
            )

        by_task: dict[str, list[int]] = defaultdict(list)
        for pi, t in enumerate(tasks):
            by_task[t].append(pi)
        record = {
            "version": version,
            "num_problems": p,
            "num_samples": n,
            "ks": list(self.ks),
            "metrics": summary(np.arange(p)),
            "per_task": {t: summary(np.asarray(ix)) for t, ix in sorted(by_task.items())},
        }
        if "turns" in cols:  # tool episodes: how they used the tool
            record["tools"] = tool_use_stats(cols["turns"], cols["tool_calls"], cols["tool_errors"])
        if "self_conf" in scores:  # the aggregate behind the stored column (the run's)
            record["self_conf"] = ec.self_conf
        if any(SCORERS[name].verdict for name in scores):
            record["judge"] = judge_report(scores, correct)
            record["judge_threshold"] = JUDGE_THRESHOLD
            record["difficulty"] = DIFFICULTY_NOTE
        return record


def format_summary(label: str, summary: dict[str, dict[str, float]], seconds: float) -> str:
    """One log line of an evaluation; `label`: "v{version}" or "teacher"."""
    parts = [
        f"{name} {m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]" for name, m in summary.items()
    ]
    return f"[eval] {label}: " + "  ".join(parts) + f"  ({seconds:.0f}s)"


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
    parser.add_argument(
        "--k",
        help="comma-separated k values overriding eval.ks (n becomes max(eval.num_samples, "
        "max k)); results of a non-default (n, ks) go to their own keys, see the module doc",
    )
    parser.add_argument(
        "--dataset",
        choices=sorted(DATASETS),
        help="evaluate on this built-in set instead of the run's held-out problems",
    )
    args = parser.parse_args(argv)
    ks = parse_ks(args.k) if args.k else None
    run = Run.open(args.run)
    run.config.sandbox.apply()  # verifiers' programs: the local pool or the run's service
    ev = Evaluator(run, ks=ks, log=lambda m: print(m, flush=True), dataset=args.dataset)
    if ev.stream != "eval":
        print(f"[eval] n={ev.n} ks={list(ev.ks)}: records in metrics/{ev.stream}/", flush=True)
    if run.config.distill.enabled:  # the ceiling each version is set against
        ev.evaluate_teacher()
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
    from pipeline.entrypoint import run_main

    sys.exit(run_main("evaluator", main))
