"""How sharp must a self-judge be to beat the vote, and how sharp can the demo's model get?

    python benchmarks/judge_ceiling.py need  RUN [--version V]
    python benchmarks/judge_ceiling.py cross RUN --judge base|N [--version V]
    python benchmarks/judge_ceiling.py probe RUN --init base|N [--steps 1000] [--batch 64]
                                       [--lr 1e-3] [--every 250] [--process] [--version V]
    python benchmarks/judge_ceiling.py temperature RUN --temperature T [--version V]
    python benchmarks/judge_ceiling.py vote RUN [--version V]
    python benchmarks/judge_ceiling.py joint RUN [--version V]

Diagnostics behind `benchmarks/results/selfprm.md` (issue 41), on a finished run of
`benchmarks/selfprm.py` or `rlax demo`; nothing is written to the run. V defaults to the
run's last evaluated version; every number is over its eval samples (`eval/v*.parquet`).

- `need`: best-of-8 by a synthetic judge whose score is `d * correct + N(0, 1)` (copies
  of one text share a score, as the real judge's do), for separations d from 1 to 4: the
  within-problem AUC such a judge has and its Self-PRM@8 - maj@8 (mean of 5 draws). It
  says what AUC the vote demands on these very samples.
- `cross`: V's samples judged by another version's weights (`base`: the SFT base): is a
  judge that was sharp on its own samples still sharp on the RL'd policy's?
- `probe`: a ceiling for the one-token verdict at this model size. From `--init`'s weights,
  `--steps` AdamW steps of class-balanced verdict cross-entropy (`tpu_jobs.orm`'s loss) on
  every labelled solve row of the run's rollouts (the RL'd policy's own samples, ~10k in
  the demo), reporting every `--every` steps the within-problem AUC and Self-PRM@8 - maj@8
  on V's samples. This is more judging data, and more directly supervised, than any recipe
  gives the judge in 10 minutes. `--process` (arithmetic only) trains and scores verdicts
  on each step prefix of a solution instead, labelled by that step's local consistency (the
  step's digits, carry-in and running result against the previous step's), and scores a
  solution by its lowest prefix verdict: a process reward model.
- `vote`: the self-judge's verdict as votes instead of a pick: each sample adds its
  verdict probability to its answer (`pipeline.metrics.weighted_vote`, PRM-weighted
  voting; also its log-odds, and the self-confidence's exp(mean log-prob)), against
  maj@8, with a paired 95% bootstrap interval over problems. The optimal aggregation of
  a verifier and a vote is such a weighted vote (Kuang et al. 2025, arXiv 2510.13918).
- `joint`: the verdict read together with the sample's own likelihood: each sample scored
  by log P(solution, "y") = its tokens' summed log-probs (the self-confidence column, a
  mean under `eval.self_conf: mean`, times its length) + log P("y" | solution), and by
  that per token (over its tokens and the verdict), picked best-of-8 against maj@8 with a
  paired 95% bootstrap interval, beside the verdict alone and the self-confidence alone.
  Does the verdict add anything to the likelihood, whose pick already ties or beats the
  vote?
- `temperature`: V evaluated again (sampled, verified, self-judged) at eval temperature T,
  nothing kept: does the vote or the judge gain from fewer sampling slips?
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.metrics import (  # noqa: E402
    best_of_k,
    bootstrap_ci,
    maj_at_k,
    weighted_vote,
    within_problem_auc,
)
from pipeline.run import Run, base_server, policy_reader  # noqa: E402
from pipeline.tasks.arithmetic import columns  # noqa: E402
from pipeline.tokenizer.run import run_tokenizer  # noqa: E402
from tpu_jobs.model.judge import self_scores  # noqa: E402
from tpu_jobs.model.state import flat_to_params, make_optimizer, new_model  # noqa: E402
from tpu_jobs.orm import class_weights, labelled_rollouts, pack_judged, verdict_step  # noqa: E402

K = 8


class Samples:
    """Version V's eval samples of `run`, as [problems, n] arrays, and the vote's result."""

    def __init__(self, run: Run, version: int | None) -> None:
        versions = sorted(int(p.stem[1:]) for p in Path(run.url, "eval").glob("v*.parquet"))
        self.version = versions[-1] if version is None else version
        table = pq.read_table(f"{run.url}/eval/v{self.version:08d}.parquet").to_pandas()
        groups = list(table.sort_values(["problem_id", "sample_index"]).groupby("problem_id"))
        problems = {p.problem_id: p for p in run.read_problems("eval")}
        self.prompts = [problems[pid].prompt for pid, _ in groups]
        self.texts = [list(g.completion.values) for _, g in groups]
        self.correct = np.array([g.reward.values >= 1 for _, g in groups])
        self.scores = np.array([g.self_score.values for _, g in groups])
        self.conf = (
            np.array([g.conf_score.values for _, g in groups]) if "conf_score" in table else None
        )
        self.answers = [[None if a is None else str(a) for a in g.answer.values] for _, g in groups]
        self.lengths = np.array([g.num_tokens.values for _, g in groups], float)
        self.maj = np.array(
            [maj_at_k(a, list(c), K) for a, c in zip(self.answers, self.correct, strict=True)],
            float,
        )

    def best_of(self, scores: np.ndarray) -> np.ndarray:
        """[problems] float: whether the highest-scored of each problem's first K samples is
        correct (`pipeline.metrics.best_of_k`, the evaluator's Self-PRM@K)."""
        return np.array(
            [best_of_k(s, c, K) for s, c in zip(scores, self.correct, strict=True)], float
        )

    def rank(self, scores: np.ndarray, label: str) -> str:
        """Within-problem AUC and best-of-K - maj@K of `scores` [problems, n]."""
        best = self.best_of(scores)
        auc = within_problem_auc(scores, self.correct).mean()
        diff = 100 * (best - self.maj).mean()
        return (
            f"{label}: AUC within a problem {auc:.3f}, Self-PRM@{K} {best.mean():.3f}, "
            f"maj@{K} {self.maj.mean():.3f}, difference {diff:+.1f} points"
        )

    def versus_vote(self, won: np.ndarray) -> str:
        """`won` [problems] (a pick's or a weighted vote's correctness) - maj@K: the mean
        with its paired 95% bootstrap interval over problems, in points, and the problems
        won and lost against the vote."""
        mean, lo, hi = bootstrap_ci(won - self.maj)
        return (
            f"- maj@{K} {100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] points (wins "
            f"{(won > self.maj).sum()}, losses {(won < self.maj).sum()})"
        )


def vote(s: Samples) -> None:
    p = np.clip(s.scores, 1e-6, 1 - 1e-6)
    weights = {"verdict probability": s.scores, "verdict log-odds": np.log(p / (1 - p))}
    if s.conf is not None:
        weights["exp(self-confidence)"] = np.exp(s.conf)
    print(f"v{s.version}: maj@{K} {s.maj.mean():.3f}")
    for name, w in weights.items():
        won = np.array(
            [weighted_vote(a, wi, c, K) for a, wi, c in zip(s.answers, w, s.correct, strict=True)],
            float,
        )
        print(f"vote weighted by {name}: {won.mean():.3f}, {s.versus_vote(won)}")


def joint_scores(
    conf: np.ndarray, lengths: np.ndarray, verdict: np.ndarray, how: str
) -> dict[str, np.ndarray]:
    """Scores to pick a sample by, [problems, n] each: the verdict P("y") alone, the
    self-confidence alone (`how`: the run's eval.self_conf, "mean" or "sum" of the
    sample's token log-probs), and log P(solution, "y") (the summed log-probs plus log
    P("y")), whole and per token (over the sample's tokens and the verdict)."""
    if how not in ("mean", "sum"):
        raise ValueError(
            f"eval.self_conf={how!r} cannot give a sample's summed log-probs; allowed: "
            "'mean', 'sum'"
        )
    solution = conf * lengths if how == "mean" else conf
    both = solution + np.log(np.clip(verdict, 1e-9, 1.0))
    return {
        "the verdict alone (Self-PRM)": verdict,
        f"self-confidence alone ({how})": conf,
        'log P(solution, "y")': both,
        'log P(solution, "y") per token': both / (lengths + 1),
    }


def joint(run: Run, s: Samples) -> None:
    if s.conf is None:
        raise SystemExit("joint needs the run's self-confidence column (eval.self_conf)")
    picks = joint_scores(s.conf, s.lengths, s.scores, run.config.eval.self_conf)
    won = s.correct[:, :K].any(axis=1).mean()
    print(f"v{s.version}: maj@{K} {s.maj.mean():.3f}, pass@{K} {won:.3f}")
    for name, scores in picks.items():
        best = s.best_of(scores)
        auc = within_problem_auc(scores, s.correct).mean()
        print(
            f"{name}: AUC within a problem {auc:.3f}, best-of-{K} {best.mean():.3f}, "
            f"{s.versus_vote(best)}"
        )


def need(s: Samples) -> None:
    print(s.rank(s.scores, f"v{s.version}'s own judge"))
    mixed = s.correct.any(1) & ~s.correct.all(1)
    print(
        f"problems with both outcomes: {mixed.sum()}, the vote right on {s.maj[mixed].mean():.3f}"
    )
    rng = np.random.default_rng(0)
    for d in (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0):
        aucs, diffs = [], []
        for _ in range(5):
            scores = np.zeros(s.correct.shape)
            for i, (texts, correct) in enumerate(zip(s.texts, s.correct, strict=True)):
                shared: dict[str, float] = {}
                for j, (text, c) in enumerate(zip(texts, correct, strict=True)):
                    shared.setdefault(text, d * c + rng.normal())
                    scores[i, j] = shared[text]
            best = s.best_of(scores)
            aucs.append(within_problem_auc(scores, s.correct).mean())
            diffs.append(100 * (best - s.maj).mean())
        print(
            f"synthetic judge d={d}: AUC within {np.mean(aucs):.3f}, difference {np.mean(diffs):+.1f}"
        )


def load(run: Run, which: str):
    fns, params = new_model(run.config.model, run.config.seed)
    snap = base_server(run).pull(0) if which == "base" else policy_reader(run).pull(int(which))
    return fns, flat_to_params(fns, params, snap.tensors)


def score(fns, params, tok, prompts: list[str], texts: list[str]) -> np.ndarray:
    p_ids = [tok.encode_prompt(p) for p in prompts]
    return self_scores(fns.merge(params), tok, p_ids, [tok.encode(t) for t in texts])


def step_prefixes(prompt: str, text: str, width: int) -> list[tuple[str, bool]]:
    """(prefix, consistent) for each column step of an arithmetic solution and its answer:
    a step is consistent when its digits, carry-in (the previous step's carry-out), carry-out,
    digit and running result are what the previous step implies."""
    left, op, right = re.fullmatch(r"([a-z\d]+)([+*])([a-z\d]+)=", prompt).groups()
    a, b = (int(re.sub(r"[a-z]", "", x)) for x in (left, right))
    size = 8 + width
    out, carry, running, parsed = [], 0, "", True
    for i, (x, y, *_rest) in enumerate(columns(op, a, b)[0]):
        seg = text[i * size : (i + 1) * size]
        m = re.fullmatch(r"[a-z](\d)[+*](\d)\+(\d)=(\d)(\d)(.*)", seg)
        ok = False
        if parsed and m and len(seg) == size:
            sx, sy, sc, st, su = (int(m.group(k)) for k in range(1, 6))
            t, u = divmod((sx + sy if op == "+" else sx * sy) + sc, 10)
            ok = (sx, sy, sc, st, su) == (x, y, carry, t, u) and (
                f"{su}{m.group(6)}".rstrip() == f"{su}{running}"
            )
            carry, running = st, f"{su}{running}"
        else:
            parsed = False
        out.append((text[: (i + 1) * size], ok))
    lead = str(carry) if carry else " "
    out.append((text, parsed and text[len(out) * size :] == f"#{lead}{running}"))
    return out


def probe(run: Run, s: Samples, args) -> None:
    tok = run_tokenizer(run)
    width = run.config.task.options_for("arithmetic").max_digits
    data = labelled_rollouts(run)
    prompts, solutions, labels = [], [], []
    rollouts = zip(data["prompt_ids"], data["solution_ids"], data["label"], strict=True)
    for p_ids, s_ids, label in rollouts:
        if args.process:
            for prefix, ok in step_prefixes(tok.decode(p_ids), tok.decode(s_ids), width):
                prompts.append(list(p_ids)), solutions.append(tok.encode(prefix)), labels.append(ok)
        else:
            prompts.append(list(p_ids)), solutions.append(list(s_ids)), labels.append(label)
    y = np.asarray(labels, bool)
    print(f"{len(y)} training rows ({y.mean():.3f} positive)", flush=True)
    tokens, mask, pos, _ = pack_judged(tok, prompts, solutions, y)
    weight = class_weights(y).astype(np.float32)

    # The eval samples, as rows to score: whole solutions, or every step prefix of them.
    e_prompts, e_texts, e_owner = [], [], []
    for i, (prompt, texts) in enumerate(zip(s.prompts, s.texts, strict=True)):
        for j, text in enumerate(texts):
            pieces = step_prefixes(prompt, text, width) if args.process else [(text, True)]
            for prefix, _ in pieces:
                e_prompts.append(prompt), e_texts.append(prefix), e_owner.append((i, j))
    rows, cols = np.asarray(e_owner).T

    def report(params, label: str) -> None:
        lowest = np.ones(s.correct.shape)
        np.minimum.at(lowest, (rows, cols), score(fns, params, tok, e_prompts, e_texts))
        print(s.rank(lowest, label), flush=True)

    fns, params = load(run, args.init)
    report(params, f"init {args.init}")
    tx = make_optimizer(args.lr, max(1, args.steps // 10), args.steps, 0.01, 1.0)
    opt = tx.init(params)

    step = verdict_step(fns, tx)
    rng, t0 = np.random.default_rng(0), time.time()
    for i in range(args.steps):
        ix = rng.integers(0, len(y), args.batch)
        params, opt, loss = step(params, opt, tokens[ix], mask[ix], pos[ix], weight[ix])
        if (i + 1) % args.every == 0 or i + 1 == args.steps:
            report(params, f"step {i + 1} (loss {float(loss):.3f}, {time.time() - t0:.0f} s)")


def temperature(run: Run, version: int, value: float) -> None:
    from tpu_jobs.evaluator import Evaluator

    ev = Evaluator(run, log=lambda _: None)
    ev.cfg = dataclasses.replace(ev.cfg, eval=dataclasses.replace(ev.cfg.eval, temperature=value))

    def policy():
        ev.policy.load(ev.reader.pull(version))
        return ev.policy

    m = ev._evaluate(version, f"v{version}", policy, samples_key=None, stream=None)["metrics"]
    parts = [
        f"{k} {m[k]['mean']:.3f} [{m[k]['lo']:.3f}, {m[k]['hi']:.3f}]"
        for k in ("pass@1", f"maj@{K}", f"self_prm@{K}", f"self_prm_vs_maj@{K}")
    ]
    # No problem has both outcomes when every sample is the same (temperature 0): no AUC.
    within = m.get("judge_auc_within")
    auc = "none (no problem with both outcomes)" if within is None else f"{within['mean']:.3f}"
    print(f"v{version} at temperature {value}: " + ", ".join(parts) + f", AUC within {auc}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("need", "cross", "probe", "temperature", "vote", "joint"))
    parser.add_argument("run")
    parser.add_argument("--version", type=int, default=None)
    parser.add_argument("--judge", default="base")
    parser.add_argument("--init", default="base")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--process", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.6)
    args = parser.parse_args()
    run = Run.open(args.run)
    s = Samples(run, args.version)
    if args.mode == "temperature":
        temperature(run, s.version, args.temperature)
    elif args.mode == "need":
        need(s)
    elif args.mode == "vote":
        vote(s)
    elif args.mode == "joint":
        joint(run, s)
    elif args.mode == "cross":
        fns, params = load(run, args.judge)
        tok = run_tokenizer(run)
        flat = [t for texts in s.texts for t in texts]
        prompts = [p for p, texts in zip(s.prompts, s.texts, strict=True) for _ in texts]
        scores = score(fns, params, tok, prompts, flat).reshape(s.correct.shape)
        print(s.rank(scores, f"v{s.version}'s samples judged by {args.judge}"))
    else:
        probe(run, s, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
