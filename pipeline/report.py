"""The human-readable report of a run: markdown + PNG plots under `report/`.

Reads only what the roles wrote (metrics records, eval summaries); never recomputes.

    report/report.md         every metric by name, per version, with 95% intervals
    report/curves.png        held-out pass@k / maj@k per version; training reward per step
    report/metrics_vs_k.png  pass@k, maj@k, self_prm@k, orm@k against k (last version)
    report/judge_buckets.png self-judgment (and ORM) precision / recall by difficulty tercile
    report/judge_vs_pass.png co-evolution per version: pass@1, judge accuracy and AUCs
                             (within-problem too), self_prm@k - maj@k, judge vs pass@1
    report/distill.png       a run with a teacher (on-policy distillation): the reverse KL
                             to the teacher per step, the gap to the teacher per version

Where self_prm@k appears, the report says what judged: `judge_provenance` of the run's
config (RL judge groups, SFT verdicts only, or a judge nothing trained).

`build_report` then feeds the run's trackers (`pipeline/tracking.py`, the `tracking`
section): by default the TensorBoard event files in `{run}/tensorboard/` of a local run
(`pipeline/tb_export.py`); MLflow and W&B get the records, the config and this report.

A library, not an entry point: the `report` job (`pipeline.report_job`), the demo and the
Airflow UI's report tab (`dags/report_plugin.py`) all import it.
"""

from __future__ import annotations

import html
import io
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.algorithms import loss_spec
from pipeline.config import RunConfig
from pipeline.layout import TEACHER_EVAL, eval_key, teacher_stream
from pipeline.run import REPORT_PREFIX, Run
from pipeline.teacher import read_pin
from pipeline.tracking import TrackedRun

REPORT_KEY = f"{REPORT_PREFIX}/report.md"


def _put(run: Run, key: str, data: bytes) -> None:
    """Reports are derived and may be regenerated: replace by compare-and-swap."""
    for _ in range(5):
        current = run.store.read_versioned(key)
        if run.store.compare_and_swap(key, data, None if current is None else current[1]):
            return
    raise RuntimeError(f"could not write {run.url}/{key}: concurrent writers")


def _fmt(m: dict[str, float] | None) -> str:
    if m is None:
        return "–"
    if m.get("lo") is None or m.get("hi") is None:  # a record without an interval
        return f"{m['mean']:.3f}"
    return f"{m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]"


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


# What each metric is (docs/evaluation.md has the full definitions). Keys are the part of
# a metric's name before "@" (or the whole name).
GLOSSARY = {
    "pass": "pass@k: P(at least one of k samples is correct), unbiased estimator from n",
    "maj": "maj@k: the majority answer of the first k samples is correct (ties: earliest)",
    "avg": "avg@k: mean correctness of the first k samples",
    "self_prm": "self_prm@k: the sample with the highest self-score among the first k is "
    "correct (Self-PRM reranking; ties: earliest)",
    "orm": "orm@k: the sample with the highest ORM score among the first k is correct",
    "self_prm_vs_maj": "self_prm_vs_maj@k: self_prm@k minus maj@k per problem, averaged; "
    "its interval is a paired bootstrap (above 0: Self-PRM reranking beats the vote)",
    "orm_vs_maj": "orm_vs_maj@k: orm@k minus maj@k per problem (paired, as above)",
    "self_conf": "self_conf@k: the sample with the highest self-confidence (its own tokens' "
    "log-probs under the evaluated version, eval.self_conf) among the first k is correct",
    "self_conf_vs_maj": "self_conf_vs_maj@k: self_conf@k minus maj@k per problem (paired, as "
    "above)",
    "mean_reward": "mean_reward: mean verifier reward over all samples",
    "judge_accuracy": "judge_accuracy: P(self-verdict == verifier), verdict = self-score > 0.5",
    "judge_auc": "judge_auc: ROC AUC of the self-score for the verifier's correctness",
    "orm_accuracy": "orm_accuracy: P(ORM verdict == verifier), verdict = ORM score > 0.5",
    "orm_auc": "orm_auc: ROC AUC of the ORM score for the verifier's correctness",
    "judge_auc_within": "judge_auc_within: ROC AUC of the self-score among one problem's "
    "samples, mean over problems with both correct and wrong samples (what reranking needs)",
    "orm_auc_within": "orm_auc_within: the same within-problem AUC for the ORM score",
    "conf_auc": "conf_auc: ROC AUC of the self-confidence for the verifier's correctness",
    "conf_auc_within": "conf_auc_within: the same within-problem AUC for the self-confidence",
}
# The rerankers of an evaluation (`tpu_jobs.evaluator.SCORERS`), in reading order, and
# their paired differences with the vote.
RERANKERS = ("self_prm", "orm", "self_conf")
VS_MAJ = tuple(f"{name}_vs_maj" for name in RERANKERS)
# Columns of the metrics-against-k table (those the record has).
K_TABLE = ("pass", "maj", *RERANKERS, *VS_MAJ)
# Columns of the co-evolution table (per version).
COEVOLUTION = (
    "pass@1",
    "judge_accuracy",
    "judge_auc",
    "judge_auc_within",
    "orm_accuracy",
    "orm_auc",
    "orm_auc_within",
    "conf_auc_within",
)
# Rerankers whose paired difference with the vote the co-evolution table and figure show.
RERANK_DIFFS = ("self_prm", "self_conf")
JUDGE_NAMES = {"self_prm": "self-judge", "orm": "ORM"}  # self-judge: the evaluated version


@dataclass(frozen=True)
class JudgeProvenance:
    """How the run's self-judge (the judge behind self_prm@k) came to judge.

    `label` is short enough for a column heading or a legend; `detail`, when there is one,
    says what it means for the numbers and where judging is trained."""

    name: str
    label: str
    detail: str
    applies: Callable[[RunConfig], bool]

    @property
    def text(self) -> str:
        """The label with its detail: what the report writes beside self_prm@k."""
        return f"{self.label}: {self.detail}" if self.detail else self.label


# First match wins, so the order is the precedence: RL judge groups train the judge
# whatever SFT did; SFT verdicts only teach it; without either, self_prm@k reranks with a
# judge nothing trained, and a reader must not take its numbers for the method's (issue
# 41: the default demo showed Self-PRM 30 points under the vote at chance-level AUC). A
# stage with 0 steps trains nothing, whatever its judge_fraction, and judge groups with
# trainer.judge_loss_weight 0 are sampled but carry no gradient.
JUDGE_PROVENANCES: tuple[JudgeProvenance, ...] = (
    JudgeProvenance(
        "rl_judge_groups",
        "trained judge (RL judge groups)",
        "",
        lambda c: (
            c.rollout.judge_fraction > 0 and c.trainer.steps > 0 and c.trainer.judge_loss_weight > 0
        ),
    ),
    JudgeProvenance(
        "sft_verdicts",
        "SFT-taught judge, not trained by RL",
        "",
        lambda c: c.sft.judge_fraction > 0 and c.sft.steps > 0,
    ),
    JudgeProvenance(
        "untrained",
        "untrained judge",
        "this run never trained judging (see configs/demo_judge.yaml / README 'Self-PRM')",
        lambda c: True,
    ),
)


def judge_provenance(cfg: RunConfig) -> JudgeProvenance:
    """The entry of `JUDGE_PROVENANCES` that describes the run's self-judge (from its
    config: `rollout.judge_fraction`, `trainer.judge_loss_weight`, `sft.judge_fraction`
    and their stages' steps)."""
    return next(p for p in JUDGE_PROVENANCES if p.applies(cfg))


# A point of a per-version series: (version, mean, lo, hi); lo and hi are None when the
# record holds no interval.
Point = tuple[int, float, float | None, float | None]


def coevolution_k(evals: list[dict[str, Any]]) -> int | None:
    """The largest k whose paired self_prm_vs_maj@k or self_conf_vs_maj@k the records hold
    (None: neither reranker was evaluated)."""
    prefixes = tuple(f"{name}_vs_maj@" for name in RERANK_DIFFS)
    ks = [int(n.split("@", 1)[1]) for e in evals for n in e["metrics"] if n.startswith(prefixes)]
    return max(ks, default=None)


def coevolution_names(evals: list[dict[str, Any]]) -> list[str]:
    """The per-version metrics of the co-evolution table and figure that the records hold:
    `COEVOLUTION`, then self_prm_vs_maj@k and self_conf_vs_maj@k at `coevolution_k`."""
    k = coevolution_k(evals)
    diffs = [f"{name}_vs_maj@{k}" for name in RERANK_DIFFS] if k is not None else []
    names = [*COEVOLUTION, *diffs]
    return [n for n in names if any(n in e["metrics"] for e in evals)]


def coevolution_series(evals: list[dict[str, Any]]) -> dict[str, list[Point]]:
    """{metric: [(version, mean, lo, hi), ...] in version order} for `coevolution_names`:
    what the co-evolution figure plots, read from the records as they are."""

    def point(version: int, m: dict[str, float]) -> Point:
        return version, m["mean"], m.get("lo"), m.get("hi")

    ordered = sorted(evals, key=lambda e: e["version"])
    return {
        name: [point(e["version"], e["metrics"][name]) for e in ordered if name in e["metrics"]]
        for name in coevolution_names(evals)
    }


def _family(name: str) -> str:
    return name.split("@", 1)[0] if "@" in name else name


FAMILY_ORDER = ("pass", "maj", "avg", *RERANKERS, *VS_MAJ, "mean_reward")
JUDGE_ORDER = ("self_prm", "orm")
BUCKET_ORDER = ("hard", "medium", "easy")


def _order(names) -> list[str]:
    """Metric names in reading order: pass@k, maj@k, self_prm@k, orm@k (k ascending),
    mean_reward, then the judge metrics; records store them alphabetically."""

    def key(name: str):
        fam = _family(name)
        rank = FAMILY_ORDER.index(fam) if fam in FAMILY_ORDER else len(FAMILY_ORDER)
        k = int(name.split("@", 1)[1]) if "@" in name and name.split("@", 1)[1].isdigit() else 0
        return rank, k, name

    return sorted(dict.fromkeys(names), key=key)


def _judges(judge: dict[str, Any]) -> list[str]:
    return sorted(judge, key=lambda j: JUDGE_ORDER.index(j) if j in JUDGE_ORDER else 99)


def _matplotlib():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def eval_streams(run: Run) -> dict[str, list[dict[str, Any]]]:
    """{stream: records sorted by version} of "eval" and the `--k` streams "eval-n*"."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key in run.store.list("metrics/eval"):
        parts = key.split("/")
        if len(parts) == 3 and (parts[1] == "eval" or parts[1].startswith("eval-n")):
            out.setdefault(parts[1], [])
    return {s: sorted(run.read_metrics(s), key=lambda r: r["version"]) for s in sorted(out)}


def richest_record(streams: dict[str, list[dict[str, Any]]], version: int) -> dict[str, Any]:
    """Of the records of `version`, the one with the most k values (the default first)."""
    found = [r for s in sorted(streams, key=lambda s: s != "eval") for r in streams[s]]
    found = [r for r in found if r["version"] == version]
    return max(found, key=lambda r: len(r.get("ks") or _ks(r)))


def _ks(record: dict[str, Any]) -> list[int]:
    return sorted({int(n.split("@")[1]) for n in record["metrics"] if n.startswith("pass@")})


def _errorbar(ax, points: list[Point], **kw) -> None:
    """One series of (version or k, mean, lo, hi) points with its 95% intervals (none drawn
    for a point without one)."""
    x = [p[0] for p in points]
    mean = [p[1] for p in points]
    err = [
        [0.0 if p[2] is None else p[1] - p[2] for p in points],
        [0.0 if p[3] is None else p[3] - p[1] for p in points],
    ]
    ax.errorbar(x, mean, yerr=err, capsize=3, **kw)


def plot_metrics_vs_k(record: dict[str, Any], judge: JudgeProvenance | None = None) -> bytes:
    """pass@k, maj@k, self_prm@k, orm@k against k for one version, with 95% intervals;
    `judge` names what self_prm@k measures (legend and title)."""
    plt = _matplotlib()
    fig, ax = plt.subplots(figsize=(6.5, 4.6))
    ks = _ks(record)
    families = (("pass", "o"), ("maj", "s"), ("self_prm", "^"), ("orm", "D"), ("self_conf", "v"))
    for fam, marker in families:
        ms = [(k, record["metrics"].get(f"{fam}@{k}")) for k in ks]
        pts = [(k, m["mean"], m.get("lo"), m.get("hi")) for k, m in ms if m is not None]
        if not pts:
            continue
        label = f"{fam}@k ({judge.label})" if fam == "self_prm" and judge else f"{fam}@k"
        _errorbar(ax, pts, marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k (samples)")
    ax.set_ylabel("held-out score (95% bootstrap CI)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    title = f"v{record['version']}: metrics against k (n={record['num_samples']})"
    if judge and f"self_prm@{ks[0]}" in record["metrics"]:
        title += "\n" + textwrap.fill(f"self_prm@k: {judge.text}", 70)
    ax.set_title(title, fontsize=9 if "\n" in title else None)
    return _png(fig)


def plot_judge_buckets(record: dict[str, Any]) -> bytes:
    """Precision and recall of the self-judgment (and ORM) per difficulty tercile."""
    plt = _matplotlib()
    judges = record.get("judge", {})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    buckets = ["hard", "medium", "easy"]
    series = [
        (f"{JUDGE_NAMES.get(j, j)} {what}", [judges[j]["by_difficulty"][b][what] for b in buckets])
        for j in _judges(judges)
        for what in ("precision", "recall")
    ]
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series):
        xs = [b + (i - (len(series) - 1) / 2) * width for b in range(len(buckets))]
        ax.bar(xs, [0 if v is None else v for v in values], width, label=label)
        for x, v in zip(xs, values, strict=True):
            if v is None:
                ax.text(x, 0.01, "n/a", ha="center", fontsize=7, rotation=90)
    counts = []
    for b in buckets:
        st = next(iter(judges.values()))["by_difficulty"][b] if judges else {}
        counts.append(f"{b}\n{st.get('problems', 0)} problems, {st.get('correct', 0)} correct")
    ax.set_xticks(range(len(buckets)), counts)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("precision = P(correct | yes), recall = P(yes | correct)")
    ax.grid(alpha=0.3, axis="y")
    if series:
        ax.legend(fontsize=8)
    ax.set_title(f"v{record['version']}: judgment by difficulty (pass-rate tercile)")
    return _png(fig)


def plot_judge_vs_pass(evals: list[dict[str, Any]], judge: JudgeProvenance | None = None) -> bytes:
    """The co-evolution of judging and solving, from `coevolution_series`: per version,
    pass@1 with the judge's accuracy and AUCs (pooled and within a problem); per version,
    self_prm@k - maj@k and self_conf@k - maj@k at the largest k (paired 95% interval: above
    0, the reranking beats the vote); and judge accuracy and within-problem AUC against pass@1
    (each point a version). `judge` (the run's `judge_provenance`) titles the figure."""
    plt = _matplotlib()
    series = coevolution_series(evals)
    k = coevolution_k(evals)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    for name, pts in series.items():
        if "_vs_maj@" not in name:
            _errorbar(ax1, pts, marker="o", label=name)
    ax1.axhline(0.5, color="grey", ls=":", lw=1)  # an AUC's chance level
    ax1.set_xlabel("weight version")
    ax1.xaxis.get_major_locator().set_params(integer=True)
    ax1.set_ylim(0, 1)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax1.set_title("judging and solving per version (95% CI; dotted: AUC chance)", fontsize=10)
    drawn = False
    for name, marker, color in zip(RERANK_DIFFS, "^v", ("C3", "C4"), strict=True):
        diff = f"{name}_vs_maj@{k}"
        if diff in series:
            _errorbar(ax2, series[diff], marker=marker, color=color, label=f"{name}@{k} - maj@{k}")
            drawn = True
    if drawn:
        ax2.legend(fontsize=8)
    else:
        ax2.text(
            0.5,
            0.5,
            "no self_prm_vs_maj@k or self_conf_vs_maj@k in the records",
            ha="center",
            transform=ax2.transAxes,
        )
    ax2.axhline(0, color="black", lw=1)  # above: the reranking beats the vote
    ax2.set_xlabel("weight version")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_ylabel(f"reranker@{k} - maj@{k} (paired, per problem)")
    ax2.grid(alpha=0.3)
    ax2.set_title(
        f"Self-PRM@{k} and self-confidence@{k} - maj@{k} per version\n(paired 95% CI; above 0: "
        "reranking beats the vote)",
        fontsize=10,
    )
    solve = {v: mean for v, mean, _, _ in series.get("pass@1", [])}
    for name, marker in (("judge_accuracy", "o"), ("judge_auc_within", "s")):
        pts = [(solve[v], mean, v) for v, mean, _, _ in series.get(name, []) if v in solve]
        if not pts:
            continue
        ax3.plot([p[0] for p in pts], [p[1] for p in pts], "-" + marker, label=name)
        for x, y, v in pts:
            ax3.annotate(f"v{v}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax3.axhline(0.5, color="grey", ls=":", lw=1)
    ax3.set_xlabel("pass@1")
    ax3.set_ylabel("judge metric")
    ax3.set_xlim(0, 1)
    ax3.set_ylim(0, 1)
    ax3.grid(alpha=0.3)
    if ax3.lines:
        ax3.legend(fontsize=8)
    ax3.set_title("self-judge accuracy and within-problem AUC against pass@1", fontsize=10)
    if judge:
        fig.suptitle(f"Co-evolution of judging and solving; self-judge: {judge.text}", fontsize=11)
    return _png(fig)


def plot_curves(train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    versions = [e["version"] for e in evals]
    if evals:
        for name in evals[0]["metrics"]:
            if not name.startswith(("pass@", "maj@")):
                continue
            mean = [e["metrics"][name]["mean"] for e in evals]
            lo = [e["metrics"][name]["mean"] - e["metrics"][name]["lo"] for e in evals]
            hi = [e["metrics"][name]["hi"] - e["metrics"][name]["mean"] for e in evals]
            ax1.errorbar(versions, mean, yerr=[lo, hi], marker="o", capsize=3, label=name)
    ax1.set_xlabel("weight version")
    ax1.set_ylabel("held-out score (95% bootstrap CI)")
    ax1.set_ylim(0, 1)
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax1.set_title("held-out evaluation per version")
    steps = [t["step"] for t in train]
    ax2.plot(steps, [t["reward_mean"] for t in train], alpha=0.4, label="batch reward")
    if len(train) >= 5:
        w = 5
        smooth = [
            sum(t["reward_mean"] for t in train[max(0, i - w + 1) : i + 1])
            / len(train[max(0, i - w + 1) : i + 1])
            for i in range(len(train))
        ]
        ax2.plot(steps, smooth, label=f"moving mean ({w})")
    ax2.set_xlabel("trainer step")
    ax2.set_ylabel("mean reward")
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3)
    ax2.legend()
    ax2.set_title("training reward per step")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def build_report(run: Run) -> str:
    """Write report/report.md and report/curves.png; return the markdown."""
    train = sorted(run.read_metrics("train"), key=lambda r: r["step"])
    evals = sorted(run.read_metrics("eval"), key=lambda r: r["version"])
    sft = run.read_metrics("sft")
    cfg = run.config
    judge = judge_provenance(cfg)
    lines = [f"# RLAX run report: `{run.url}`", ""]
    lines += [
        f"- model preset `{cfg.model.preset}`, tasks {', '.join(cfg.task.families)}, "
        f"algorithm `{cfg.trainer.algorithm}`, {cfg.trainer.steps} RL steps of "
        f"{cfg.rollout.prompts_per_batch} prompts x G={cfg.rollout.group_size}, "
        f"max_staleness {cfg.trainer.max_staleness}",
    ]
    if sft:
        lines.append(
            f"- SFT bootstrap: {len(sft) and sft[-1]['index']} steps, final loss "
            f"{sft[-1]['loss']:.4f}"
        )
    if train:
        lines.append(
            f"- RL: {len(train)} steps, batch reward {train[0]['reward_mean']:.3f} -> "
            f"{train[-1]['reward_mean']:.3f}; dropped batches "
            f"{train[-1].get('dropped_total', 0)}"
        )
    lines += ["", "## Held-out evaluation per version", ""]
    lines += _judge_lines(judge, evals)
    if evals:
        names = _order(n for e in evals for n in e["metrics"])
        lines.append("| version | " + " | ".join(names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for e in evals:
            lines.append(
                f"| v{e['version']} | "
                + " | ".join(_fmt(e["metrics"].get(n)) for n in names)
                + " |"
            )
        first, last = evals[0], evals[-1]
        lines += ["", f"Change from v{first['version']} to v{last['version']}:", ""]
        for n in names:
            if n not in first["metrics"] or n not in last["metrics"]:
                continue
            d = last["metrics"][n]["mean"] - first["metrics"][n]["mean"]
            lines.append(
                f"- {n}: {first['metrics'][n]['mean']:.3f} -> "
                f"{last['metrics'][n]['mean']:.3f} ({d * 100:+.1f} points)"
            )
        lines += ["", "Per task family (last version):", ""]
        for task, summary in last.get("per_task", {}).items():
            lines.append(
                f"- {task}: " + ", ".join(f"{n} {_fmt(summary[n])}" for n in _order(summary))
            )
        lines += [
            "",
            f"Intervals are 95% percentile bootstrap over {first['num_problems']} "
            f"held-out problems, n={first['num_samples']} samples each.",
        ]
    else:
        lines.append("No version has been evaluated yet: `rlax eval --run RUN`.")
    lines += ["", "![curves](curves.png)", ""]
    pngs = {f"{REPORT_PREFIX}/curves.png": plot_curves(train, evals)}
    streams = eval_streams(run)
    if evals or streams:
        last_version = max(
            [e["version"] for e in evals] or [r["version"] for rs in streams.values() for r in rs]
        )
        rich = richest_record(streams, last_version)
        lines += _k_section(rich, judge)
        pngs[f"{REPORT_PREFIX}/metrics_vs_k.png"] = plot_metrics_vs_k(rich, judge)
        lines += ["", "![metrics against k](metrics_vs_k.png)", ""]
        if rich.get("judge"):
            lines += _bucket_section(rich)
            pngs[f"{REPORT_PREFIX}/judge_buckets.png"] = plot_judge_buckets(rich)
            lines += ["", "![judgment by difficulty](judge_buckets.png)", ""]
        if len(coevolution_names(evals)) > 1:  # more than pass@1: a judge or a confidence
            lines += _coevolution_section(evals, judge)
            pngs[f"{REPORT_PREFIX}/judge_vs_pass.png"] = plot_judge_vs_pass(evals, judge)
            lines += ["", "![co-evolution of judging and solving](judge_vs_pass.png)", ""]
    lines += _tools_section(run, train, evals)
    if cfg.distill.enabled:
        distill_lines, distill_pngs = _distill_section(run, train, evals)
        lines += distill_lines
        pngs.update(distill_pngs)
    lines += _orm_section(run)
    lines += _glossary(evals, streams, judge)
    md = "\n".join(lines)
    for key, data in pngs.items():
        _put(run, key, data)
    _put(run, REPORT_KEY, md.encode())
    _refresh_trackers(run)
    return md


def _judge_lines(judge: JudgeProvenance, evals: list[dict[str, Any]]) -> list[str]:
    """What self_prm@k measures in this run, beside the judge's within-problem AUC at the
    last version (the ranking skill reranking needs; 0.5 is chance). None without
    Self-PRM metrics."""
    if not any(n.startswith("self_prm@") for e in evals for n in e["metrics"]):
        return []
    last = max(evals, key=lambda e: e["version"])
    return [
        f"Self-PRM's judge (self_prm@k): **{judge.label}**"
        + (f": {judge.detail}" if judge.detail else "")
        + f". The judge's within-problem AUC (judge_auc_within) at v{last['version']}: "
        f"{_fmt(last['metrics'].get('judge_auc_within'))} (0.5 = chance).",
        "",
    ]


# Families of the metrics-against-k table whose judge is the run's self-judge.
SELF_JUDGED = ("self_prm", "self_prm_vs_maj")


def _k_section(rec: dict[str, Any], judge: JudgeProvenance) -> list[str]:
    ks = _ks(rec)
    fams = [f for f in K_TABLE if f"{f}@{ks[0]}" in rec["metrics"]]
    heads = [f"{f}@k ({judge.label})" if f in SELF_JUDGED else f"{f}@k" for f in fams]
    lines = [
        "",
        f"## Metrics against k (v{rec['version']}, n={rec['num_samples']} samples per problem)",
        "",
        "| k | " + " | ".join(heads) + " |",
        "|---|" + "---|" * len(fams),
    ]
    for k in ks:
        cells = [_fmt(rec["metrics"].get(f"{f}@{k}")) for f in fams]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def _bucket_section(rec: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## Self-judgment by difficulty (v{rec['version']})",
        "",
        f"Verdict = score > {rec.get('judge_threshold', 0.5)}; precision = P(correct | judged "
        f"yes), recall = P(judged yes | correct); {rec.get('difficulty', '')}.",
        "",
        "| judge | bucket | problems | pass rate | samples | correct | judged yes | true pos "
        "| precision | recall | accuracy | AUC |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for judge in _judges(rec["judge"]):
        rep = rec["judge"][judge]
        rows = [("all", {**rep["overall"], "problems": rec["num_problems"]})]
        rows += [(b, rep["by_difficulty"][b]) for b in BUCKET_ORDER if b in rep["by_difficulty"]]
        for bucket, st in rows:
            rate = (
                f"{st['pass_rate_min']:.2f}–{st['pass_rate_max']:.2f}"
                if st.get("pass_rate_min") is not None
                else "–"
            )
            lines.append(
                f"| {JUDGE_NAMES.get(judge, judge)} | {bucket} | {st['problems']} | {rate} | "
                f"{st['samples']} | {st['correct']} | {st['judged_yes']} | {st['true_pos']} | "
                f"{_num(st['precision'])} | {_num(st['recall'])} | {_num(st['accuracy'])} | "
                f"{_num(st['auc'])} |"
            )
    return lines


def _coevolution_section(evals: list[dict[str, Any]], judge: JudgeProvenance) -> list[str]:
    names = coevolution_names(evals)
    lines = [
        "",
        "## Judging and solving per version (co-evolution)",
        "",
        f"Self-judge: {judge.text}. Whether judging rose with solving: the judge's accuracy "
        "and AUCs (pooled, and within a problem: what reranking needs) next to pass@1, and "
        "self_prm@k - maj@k at the largest k (paired per problem; above 0: the self-judge's "
        "pick beats the vote); beside them the self-confidence's within-problem AUC and "
        "self_conf@k - maj@k (the sample's own token log-probs, no judge).",
        "",
        "| version | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for e in evals:
        lines.append(
            f"| v{e['version']} | " + " | ".join(_fmt(e["metrics"].get(n)) for n in names) + " |"
        )
    return lines


def time_split(
    train: list[dict[str, Any]], rollouts: list[dict[str, Any]]
) -> list[dict[str, float]]:
    """Per trainer step: seconds of generation, of tool execution and of waiting on tools
    (the part of it decoding did not hide), from the committed rollout record of the
    step's batch, and of training (the step's own record)."""
    made = {r["batch_index"]: r for r in rollouts if r.get("committed") and "tool_s" in r}
    out = []
    for t in train:
        r = made.get(t.get("batch_index"))
        if r is not None:
            out.append(
                {
                    "step": t["step"],
                    "generate_s": float(r["generate_s"]),
                    "tool_s": float(r["tool_s"]),
                    "tool_wait_s": float(r.get("tool_wait_s", r["tool_s"])),
                    "train_s": float(t["step_s"]),
                }
            )
    return out


def _rate(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def _tools_section(run: Run, train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> list[str]:
    """Tool episodes: tool use per evaluated version and per step, and each step's time
    split between generation, tool execution and training."""
    steps = [t for t in train if t.get("tools")]
    versions = [e for e in evals if e.get("tools")]
    if not steps and not versions:
        return []
    head = (
        "| mean turns | tool-call rate | calls per episode | call success | failed calls by kind |"
    )
    lines = ["", f"## Tool episodes (environment `{run.config.environment.name}`)", ""]

    def cells(st: dict[str, Any]) -> str:
        errors = ", ".join(f"{k} {n}" for k, n in st["tool_errors"].items() if n) or "none"
        return (
            f"{st['mean_turns']:.2f} | {st['tool_call_rate']:.3f} | "
            f"{st['calls_per_episode']:.2f} | {_rate(st['tool_success_rate'])} | {errors} |"
        )

    if versions:
        lines += ["| version | pass@1 " + head, "|---|---|---|---|---|---|---|"]
        for e in versions:
            lines.append(
                f"| v{e['version']} | {_fmt(e['metrics'].get('pass@1'))} | " + cells(e["tools"])
            )
        lines.append("")
    split = {s["step"]: s for s in time_split(train, run.read_metrics("rollout"))}
    if steps:
        lines += [
            "| step " + head + " generation s | tools s (waited) | training s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        every = max(1, len(steps) // 20)  # at most ~20 rows
        for t in steps[::every]:
            sp = split.get(t["step"])
            times = (
                f" {sp['generate_s']:.1f} | {sp['tool_s']:.1f} ({sp['tool_wait_s']:.1f}) | "
                f"{sp['train_s']:.1f} |"
                if sp
                else " – | – | – |"
            )
            lines.append(f"| {t['step']} | " + cells(t["tools"]) + times)
    if split:
        total = {k: sum(s[k] for s in split.values()) for k in ("generate_s", "tool_s", "train_s")}
        whole = sum(total.values()) or 1.0
        lines += [
            "",
            f"Time over {len(split)} steps: generation {total['generate_s']:.0f} s "
            f"({100 * total['generate_s'] / whole:.0f}%), tool execution {total['tool_s']:.0f} s "
            f"({100 * total['tool_s'] / whole:.0f}%), training {total['train_s']:.0f} s "
            f"({100 * total['train_s'] / whole:.0f}%); generation and tools are the rollout "
            "workers' (they run beside the trainer; tool calls run while other rows decode, "
            "the part that decoding did not hide is the waited time), training the "
            "trainer's step.",
        ]
    return lines


# ------------------------------------------------------------ on-policy distillation

DISTILL_PNG = f"{REPORT_PREFIX}/distill.png"
REVERSE_KL_ROWS = 6  # steps of the reverse-KL table: the first, the last, evenly between


def spread(items: Sequence[Any], count: int) -> list[Any]:
    """At most `count` of `items`, evenly spaced, the first and the last included."""
    if len(items) <= count:
        return list(items)
    last = len(items) - 1
    picks = sorted({round(i * last / (count - 1)) for i in range(count)})
    return [items[i] for i in picks]


def teacher_gap(
    student: dict[str, Sequence[Any]],
    teacher: dict[str, Sequence[Any]],
    k: int,
    *,
    n_boot: int,
    seed: int,
) -> dict[str, float] | None:
    """The student's pass@k minus the teacher's, paired per problem: {mean, lo, hi}, the
    95% percentile bootstrap over problems of the per-problem differences (the interval
    self_prm_vs_maj@k has, `pipeline.metrics.bootstrap_ci`). Each side: per-sample
    columns (`problem_id`, `reward`) of one evaluation. None when they cannot be paired:
    other problems, or a problem with fewer than k samples."""
    import numpy as np

    from pipeline.metrics import bootstrap_ci, per_problem_pass

    mine, theirs = per_problem_pass(student, k), per_problem_pass(teacher, k)
    if mine is None or theirs is None or set(mine) != set(theirs):
        return None
    diff = np.asarray([mine[pid] - theirs[pid] for pid in mine])
    mean, lo, hi = bootstrap_ci(diff, n_boot=n_boot, seed=seed)
    return {"mean": mean, "lo": lo, "hi": hi}


def gap_names(teacher: dict[str, Any], evals: list[dict[str, Any]]) -> list[str]:
    """pass@1 and pass@k at the largest k that the teacher's record and a version's hold."""
    ks = {int(n[5:]) for n in teacher["metrics"] if n.startswith("pass@") and n[5:].isdigit()}
    ks &= {int(n[5:]) for e in evals for n in e["metrics"] if n.startswith("pass@")}
    return [f"pass@{k}" for k in sorted({1, max(ks)} & ks)] if ks else []


def teacher_gaps(
    run: Run, teacher: dict[str, Any], evals: list[dict[str, Any]]
) -> dict[int, dict[str, dict[str, float | None]]]:
    """{version: {metric of `gap_names`: {mean, lo, hi}}}: the version's metric minus the
    teacher's. Paired per problem from the per-sample tables (`teacher_gap`) where both
    are stored and pair; else the difference of the records' means, without an interval
    (lo and hi None)."""
    from pipeline.parquet_bytes import table_from_bytes

    def columns(key: str) -> dict[str, list[Any]] | None:
        if not run.store.exists(key):
            return None
        return table_from_bytes(run.store.read(key)).select(["problem_id", "reward"]).to_pydict()

    ec = run.config.eval
    theirs = columns(eval_key(TEACHER_EVAL, teacher["num_samples"], ec.num_samples))
    out: dict[int, dict[str, dict[str, float | None]]] = {}
    for e in evals:
        mine = columns(eval_key(e["version"], e["num_samples"], ec.num_samples))
        row: dict[str, dict[str, float | None]] = {}
        for name in gap_names(teacher, evals):
            if name not in e["metrics"]:
                continue
            paired = None
            if mine is not None and theirs is not None:
                k = int(name.split("@")[1])
                paired = teacher_gap(mine, theirs, k, n_boot=ec.bootstrap, seed=run.config.seed)
            diff = e["metrics"][name]["mean"] - teacher["metrics"][name]["mean"]
            row[name] = paired or {"mean": diff, "lo": None, "hi": None}
        out[e["version"]] = row
    return out


def plot_distill(
    train: list[dict[str, Any]], gaps: dict[int, dict[str, dict[str, float | None]]]
) -> bytes:
    """The reverse KL to the teacher per trainer step; the gap to the teacher per version
    (student minus teacher, 95% paired intervals where there are some)."""
    plt = _matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    pts = [(t["step"], t["reverse_kl"]) for t in train if "reverse_kl" in t]
    ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30 else None)
    ax1.set_xlabel("trainer step")
    ax1.xaxis.get_major_locator().set_params(integer=True)
    ax1.set_ylabel("mean log pi_old - log pi_teacher")
    ax1.grid(alpha=0.3)
    ax1.set_title("reverse KL to the teacher (sampled tokens)", fontsize=10)
    names = list(dict.fromkeys(n for row in gaps.values() for n in row))
    for name, marker in zip(names, ("o", "s"), strict=False):
        series = [
            (v, g[name]["mean"], g[name]["lo"], g[name]["hi"])
            for v, g in sorted(gaps.items())
            if name in g
        ]
        _errorbar(ax2, series, marker=marker, label=f"{name} student - teacher")
    ax2.axhline(0, color="black", lw=1)  # 0: the teacher's level
    ax2.set_xlabel("weight version")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.grid(alpha=0.3)
    if names:
        ax2.legend(fontsize=8)
    ax2.set_title("gap to the teacher per version (95% paired CI)", fontsize=10)
    return _png(fig)


def _distill_section(
    run: Run, train: list[dict[str, Any]], evals: list[dict[str, Any]]
) -> tuple[list[str], dict[str, bytes]]:
    """The Distillation section of a run with a teacher: which teacher, the reverse KL at
    a few steps, the gap to the teacher per evaluated version; and its figure."""
    cfg, tc = run.config.distill, run.config.trainer
    coef = loss_spec(tc.algorithm, **tc.loss_overrides()).distill_coef
    pin = read_pin(run)
    who = pin.describe() if pin else f"{cfg.teacher} (not pinned yet)"
    lines = [
        "",
        "## Distillation",
        "",
        f"- teacher: {who}; requested version `{cfg.teacher_version}`",
        f"- objective: algorithm `{tc.algorithm}`"
        + (f", the distillation advantage mixed in at distill_coef {coef}" if coef > 0 else ""),
    ]
    kl = [t for t in train if "reverse_kl" in t]
    if kl:
        lines += [
            "",
            "Reverse KL to the teacher, mean of log pi_old - log pi_teacher over the batch's "
            "sampled tokens (what the distillation advantage drives down):",
            "",
            "| step | reverse KL |",
            "|---|---|",
            *(f"| {t['step']} | {t['reverse_kl']:.4f} |" for t in spread(kl, REVERSE_KL_ROWS)),
        ]
    records = run.read_metrics(teacher_stream("eval"))
    gaps: dict[int, dict[str, dict[str, float | None]]] = {}
    if not records:
        lines += ["", "The teacher has not been evaluated yet: `rlax eval --run RUN` does it."]
    else:
        teacher = records[0]
        names = gap_names(teacher, evals)
        lines += [
            "",
            f"The teacher on the held-out set (n={teacher['num_samples']}): "
            + ", ".join(f"{n} {_fmt(teacher['metrics'][n])}" for n in names)
            + ".",
        ]
        if evals and names:
            gaps = teacher_gaps(run, teacher, evals)
            lines += [
                "",
                "Gap to the teacher per version (student minus teacher; the interval is a "
                "paired bootstrap over problems, none where the samples cannot be paired):",
                "",
                "| version | " + " | ".join(f"{n} - teacher" for n in names) + " |",
                "|---|" + "---|" * len(names),
            ]
            for e in evals:
                g = gaps[e["version"]]
                lines.append(
                    f"| v{e['version']} | " + " | ".join(_fmt(g.get(n)) for n in names) + " |"
                )
    if not kl and not gaps:
        return lines, {}
    lines += ["", "![distillation](distill.png)", ""]
    return lines, {DISTILL_PNG: plot_distill(train, gaps)}


def _orm_section(run: Run) -> list[str]:
    recs = run.read_metrics("orm")
    if not recs:
        return []
    r = recs[0]
    b, a = r["val_before"], r["val"]
    return [
        "",
        "## ORM baseline",
        "",
        f"- model `{r['model']['preset']}` (hidden {r['model']['hidden_size']}), initialised "
        f"from {r['init']}, {r['steps']} steps on {r['train_rows']} labelled rollouts "
        f"({r['train_positives']} correct); held out {r['val_rows']} rows "
        f"({r['val_positives']} correct) of unseen prompts",
        f"- held-out accuracy {_num(b['accuracy'])} -> {_num(a['accuracy'])}, balanced "
        f"accuracy {_num(b['balanced_accuracy'])} -> {_num(a['balanced_accuracy'])}, AUC "
        f"{_num(b['auc'])} -> {_num(a['auc'])}, verdict loss {_num(b['loss'])} -> "
        f"{_num(a['loss'])} (before -> after training)",
    ]


def _glossary(
    evals: list[dict[str, Any]],
    streams: dict[str, list[dict[str, Any]]],
    judge: JudgeProvenance,
) -> list[str]:
    names = _order(
        [n for e in evals for n in e["metrics"]]
        + [n for rs in streams.values() for r in rs for n in r["metrics"]]
    )
    fams = list(dict.fromkeys(_family(n) for n in names))
    lines = ["", "## Metrics", ""]
    for fam in fams:
        members = [n for n in names if _family(n) == fam]
        said = f" Self-judge of this run: {judge.text}." if fam in SELF_JUDGED else ""
        lines.append(f"- {GLOSSARY.get(fam, fam)}.{said} Reported: {', '.join(members)}.")
    lines += [
        "",
        "Every interval is a 95% percentile bootstrap over problems; definitions in "
        "docs/evaluation.md.",
    ]
    return lines


def _refresh_trackers(run: Run) -> None:
    """Feed the run's trackers (`tracking.backends`: TensorBoard files of a local run,
    MLflow, W&B) with the records and this report. A tracker that fails is reported in
    one line and retried by the next export; the report itself is complete either way."""
    from pipeline.tracking import export

    export(run, log=lambda m: print(f"[report] {m}", flush=True))


def headline(evals: list[dict[str, Any]]) -> str:
    """The run's result in a few lines: pass@1 and pass@k (the largest k evaluated) per
    evaluated version, with 95% intervals, and the change from the first to the last
    version in points. For the log of the `report` task (the full report is report.md)."""
    if not evals:
        return "No version has been evaluated yet."
    evals = sorted(evals, key=lambda e: e["version"])
    ks = sorted(
        {
            int(n[5:])
            for e in evals
            for n in e["metrics"]
            if n[5:].isdigit() and n.startswith("pass@")
        }
    )
    names = [f"pass@{k}" for k in dict.fromkeys([1, ks[-1]] if ks else [1])]
    rows = [["version", *names]]
    rows += [[f"v{e['version']}", *(_fmt(e["metrics"].get(n)) for n in names)] for e in evals]
    first, last = evals[0], evals[-1]
    change = []
    for n in names:
        if n in first["metrics"] and n in last["metrics"]:
            d = last["metrics"][n]["mean"] - first["metrics"][n]["mean"]
            change.append(f"{d * 100:+.1f} points")
        else:
            change.append("–")
    rows.append([f"v{first['version']} -> v{last['version']}", *change])
    widths = [max(len(r[i]) for r in rows) for i in range(len(names) + 1)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


# The page of the report in the Airflow UI (dags/report_plugin.py): plain HTML, the plots
# by relative URL (the page's URL ends with "/"), styled for an iframe inside the UI.
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>RLAX run report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1rem 1.5rem; color: #1a202c; }}
table {{ border-collapse: collapse; margin: 0.5rem 0; font-size: 0.85rem; }}
th, td {{ border: 1px solid #cbd5e0; padding: 0.2rem 0.5rem; text-align: left; }}
th {{ background: #edf2f7; }}
img {{ max-width: 100%; border: 1px solid #e2e8f0; }}
code {{ background: #edf2f7; padding: 0 0.2rem; }}
.note {{ color: #4a5568; }}
</style></head>
<body><div class="note">{note}</div>{links}{body}</body></html>
"""
TRACKER_NAMES = {"mlflow": "MLflow", "wandb": "Weights & Biases"}


def tracker_links(tracked: Sequence[TrackedRun]) -> str:
    """The tracked runs as an HTML line of links (each opens in a new tab: trackers refuse
    to be framed), or a plain mention for one without a web page (an offline W&B run)."""
    items = []
    for t in tracked:
        label = html.escape(f"{TRACKER_NAMES.get(t.sink, t.sink)} run {t.run_id}")
        if t.url.startswith(("http://", "https://")):
            href = html.escape(t.url, quote=True)
            items.append(f'<a href="{href}" target="_blank" rel="noopener">{label}</a>')
        else:
            items.append(f"{label} (no web page: offline)")
    return f'<p class="note">Tracked: {" · ".join(items)}</p>' if items else ""


def report_html(markdown: str | None, note: str, tracked: Sequence[TrackedRun] = ()) -> str:
    """A report (markdown, or None), a note above it and links to the run's trackers as one
    HTML page. Raw HTML in the markdown is escaped, not rendered (CommonMark with html off,
    plus tables)."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    return PAGE.format(
        note=md.render(note),
        links=tracker_links(tracked),
        body=md.render(markdown) if markdown else "",
    )
