"""The human-readable report of a run: markdown + PNG plots under `report/`.

Reads only what the roles wrote (metrics records, eval summaries); never recomputes.
"""

from __future__ import annotations

import io
from typing import Any

from pipeline.run import Run


def _put(run: Run, key: str, data: bytes) -> None:
    """Reports are derived and may be regenerated: replace by compare-and-swap."""
    for _ in range(5):
        current = run.store.read_versioned(key)
        if run.store.compare_and_swap(key, data, None if current is None else current[1]):
            return
    raise RuntimeError(f"could not write {run.url}/{key}: concurrent writers")


def _fmt(m: dict[str, float]) -> str:
    return f"{m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]"


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
    if evals:
        names = list(evals[0]["metrics"])
        lines.append("| version | " + " | ".join(names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for e in evals:
            lines.append(
                f"| v{e['version']} | " + " | ".join(_fmt(e["metrics"][n]) for n in names) + " |"
            )
        first, last = evals[0], evals[-1]
        lines += ["", f"Change from v{first['version']} to v{last['version']}:", ""]
        for n in names:
            d = last["metrics"][n]["mean"] - first["metrics"][n]["mean"]
            lines.append(
                f"- {n}: {first['metrics'][n]['mean']:.3f} -> "
                f"{last['metrics'][n]['mean']:.3f} ({d * 100:+.1f} points)"
            )
        lines += ["", "Per task family (last version):", ""]
        for task, summary in last.get("per_task", {}).items():
            lines.append(f"- {task}: " + ", ".join(f"{n} {_fmt(m)}" for n, m in summary.items()))
        lines += [
            "",
            f"Intervals are 95% percentile bootstrap over {first['num_problems']} "
            f"held-out problems, n={first['num_samples']} samples each.",
        ]
    else:
        lines.append("No version has been evaluated yet: `rlax eval --run RUN`.")
    lines += ["", "![curves](curves.png)", ""]
    md = "\n".join(lines)
    _put(run, "report/curves.png", plot_curves(train, evals))
    _put(run, "report/report.md", md.encode())
    return md
