"""pipeline.report's headline table (the report task's log) and HTML page (the UI's tab)."""

from __future__ import annotations

from pipeline.report import headline, report_html


def _m(mean: float) -> dict[str, float]:
    return {"mean": mean, "lo": mean - 0.05, "hi": mean + 0.05}


def test_headline_is_pass1_and_the_largest_k_per_version_with_the_change():
    evals = [  # out of order, as a store may list them
        {"version": 40, "metrics": {"pass@1": _m(0.5), "pass@8": _m(0.875), "maj@8": _m(0.6)}},
        {"version": 0, "metrics": {"pass@1": _m(0.25), "pass@8": _m(0.75), "pass@2": _m(0.4)}},
    ]
    lines = headline(evals).splitlines()
    assert lines[0].split() == ["version", "|", "pass@1", "|", "pass@8"]
    assert lines[2].startswith("v0 ") and "0.250 [0.200, 0.300]" in lines[2]
    assert lines[3].startswith("v40") and "0.875 [0.825, 0.925]" in lines[3]
    # 0.25 -> 0.5 and 0.75 -> 0.875, in points
    assert [c.strip() for c in lines[4].split("|")] == ["v0 -> v40", "+25.0 points", "+12.5 points"]
    assert "maj@8" not in headline(evals)
    assert headline([]) == "No version has been evaluated yet."


def test_report_html_renders_tables_and_plots_and_escapes_html():
    page = report_html(
        "| v | pass@1 |\n|---|---|\n| v0 | <script>alert(1)</script> |\n\n![curves](curves.png)",
        "Run `gs://b/r`",
    )
    assert "<table>" in page and "<td>v0</td>" in page
    assert "<script>alert" not in page and "&lt;script&gt;" in page
    assert '<img src="curves.png" alt="curves" />' in page
    assert "<code>gs://b/r</code>" in page
    assert "<table>" not in report_html(None, "no report yet")


def test_time_split_joins_each_step_with_its_committed_batch():
    from pipeline.report import time_split

    train = [
        {"step": 1, "batch_index": 0, "step_s": 2.0},
        {"step": 2, "batch_index": 1, "step_s": 3.0},
        {"step": 3, "batch_index": 2, "step_s": 1.0},  # its batch has no tool timing
    ]
    rollouts = [
        {"batch_index": 0, "committed": False, "generate_s": 9.0, "tool_s": 9.0},  # discarded
        {"batch_index": 0, "committed": True, "generate_s": 4.0, "tool_s": 1.5, "tool_wait_s": 0.5},
        {"batch_index": 1, "committed": True, "generate_s": 5.0, "tool_s": 0.5},
        {"batch_index": 2, "committed": True, "seconds": 3.0},  # a single-turn batch
    ]
    assert time_split(train, rollouts) == [
        {"step": 1, "generate_s": 4.0, "tool_s": 1.5, "tool_wait_s": 0.5, "train_s": 2.0},
        {"step": 2, "generate_s": 5.0, "tool_s": 0.5, "tool_wait_s": 0.5, "train_s": 3.0},
    ]


# -- what judged self_prm@k, and the co-evolution figure's data (issue 41) ----------------

UNTRAINED = (
    "untrained judge: this run never trained judging "
    "(see configs/demo_judge.yaml / README 'Self-PRM')"
)


def _config(**sections):
    """A hand-made run config: the defaults with the given sections' fields replaced."""
    from dataclasses import replace

    from pipeline.config import RunConfig

    cfg = RunConfig(tracking=replace(RunConfig().tracking, backends=()))  # no tracker to feed
    return replace(cfg, **{s: replace(getattr(cfg, s), **v) for s, v in sections.items()})


JUDGING_CONFIGS = {  # name -> (sections, the text the report writes beside self_prm@k)
    "rl_judge_groups": (
        {"rollout": {"judge_fraction": 0.5}, "sft": {"judge_fraction": 0.25}},
        "trained judge (RL judge groups)",
    ),
    "sft_verdicts": ({"sft": {"judge_fraction": 0.25}}, "SFT-taught judge, not trained by RL"),
    "untrained": ({}, UNTRAINED),
}


def test_judge_provenance_of_each_judging_config():
    from pipeline.report import judge_provenance

    for name, (sections, text) in JUDGING_CONFIGS.items():
        got = judge_provenance(_config(**sections))
        assert (got.name, got.text) == (name, text)
    # A stage with no steps trains nothing, whatever its judge fraction.
    no_rl = _config(rollout={"judge_fraction": 0.5}, trainer={"steps": 0})
    assert judge_provenance(no_rl).name == "untrained"
    no_sft = _config(
        rollout={"judge_fraction": 0.5},
        trainer={"steps": 0},
        sft={"judge_fraction": 0.25, "steps": 0},
    )
    assert judge_provenance(no_sft).name == "untrained"
    # Judge groups weighted 0 train nothing: the SFT verdicts are all the judge learned.
    unweighted = _config(
        rollout={"judge_fraction": 0.5},
        trainer={"judge_loss_weight": 0.0},
        sft={"judge_fraction": 0.25},
    )
    assert judge_provenance(unweighted).name == "sft_verdicts"
    rl_without_sft_verdicts = _config(rollout={"judge_fraction": 0.25})
    assert judge_provenance(rl_without_sft_verdicts).name == "rl_judge_groups"


def _iv(mean: float, lo: float, hi: float) -> dict[str, float]:
    return {"mean": mean, "lo": lo, "hi": hi}


def _eval_records() -> list[dict]:
    """Two evaluated versions, out of order; v0 has no problem with both outcomes (no
    judge_auc_within) and an old-style self_prm_vs_maj@8 without an interval."""
    v4 = {
        "pass@1": _iv(0.5, 0.4, 0.6),
        "pass@8": _iv(0.9, 0.8, 1.0),
        "maj@1": _iv(0.5, 0.4, 0.6),
        "maj@8": _iv(0.7, 0.6, 0.8),
        "self_prm@1": _iv(0.5, 0.4, 0.6),
        "self_prm@8": _iv(0.6, 0.5, 0.7),
        "self_prm_vs_maj@1": _iv(0.0, 0.0, 0.0),
        "self_prm_vs_maj@8": _iv(-0.1, -0.2, -0.05),
        "judge_accuracy": _iv(0.6, 0.55, 0.65),
        "judge_auc": _iv(0.7, 0.6, 0.8),
        "judge_auc_within": _iv(0.55, 0.45, 0.65),
        "self_conf_vs_maj@8": _iv(0.02, 0.01, 0.03),
    }
    v0 = {
        "pass@1": _iv(0.25, 0.2, 0.3),
        "pass@8": _iv(0.75, 0.7, 0.8),
        "maj@1": _iv(0.25, 0.2, 0.3),
        "maj@8": _iv(0.5, 0.4, 0.6),
        "self_prm@1": _iv(0.25, 0.2, 0.3),
        "self_prm@8": _iv(0.5, 0.4, 0.6),
        "self_prm_vs_maj@1": _iv(0.0, 0.0, 0.0),
        "self_prm_vs_maj@8": {"mean": 0.0},
        "judge_accuracy": _iv(0.5, 0.45, 0.55),
        "judge_auc": _iv(0.5, 0.4, 0.6),
    }
    common = {"num_problems": 10, "num_samples": 8, "ks": [1, 8]}
    return [{"version": 4, "metrics": v4, **common}, {"version": 0, "metrics": v0, **common}]


def test_coevolution_series_per_version_at_the_largest_k():
    from pipeline.report import coevolution_k, coevolution_series

    evals = _eval_records()
    assert coevolution_k(evals) == 8
    assert coevolution_series(evals) == {
        "pass@1": [(0, 0.25, 0.2, 0.3), (4, 0.5, 0.4, 0.6)],
        "judge_accuracy": [(0, 0.5, 0.45, 0.55), (4, 0.6, 0.55, 0.65)],
        "judge_auc": [(0, 0.5, 0.4, 0.6), (4, 0.7, 0.6, 0.8)],
        "judge_auc_within": [(4, 0.55, 0.45, 0.65)],
        "self_prm_vs_maj@8": [(0, 0.0, None, None), (4, -0.1, -0.2, -0.05)],
        "self_conf_vs_maj@8": [(4, 0.02, 0.01, 0.03)],
    }
    # Without Self-PRM or self-confidence there is no difference to plot.
    plain = [{"version": 0, "metrics": {"pass@1": _iv(0.25, 0.2, 0.3)}}]
    assert coevolution_k(plain) is None
    assert coevolution_series(plain) == {"pass@1": [(0, 0.25, 0.2, 0.3)]}
    # eval.self_prm off, self-confidence on: its difference alone, at its own largest k.
    conf = {"pass@1": _iv(0.25, 0.2, 0.3), "self_conf_vs_maj@4": _iv(0.02, 0.0, 0.04)}
    conf_only = [{"version": 0, "metrics": conf}]
    assert coevolution_k(conf_only) == 4
    assert coevolution_series(conf_only) == {
        "pass@1": [(0, 0.25, 0.2, 0.3)],
        "self_conf_vs_maj@4": [(0, 0.02, 0.0, 0.04)],
    }


def _report_of(tmp_path, name: str) -> str:
    from pipeline.report import build_report
    from pipeline.run import Run

    run = Run.create(str(tmp_path / name), _config(**JUDGING_CONFIGS[name][0]))
    for record in _eval_records():
        run.log_metrics("eval", record["version"], record)
    return build_report(run)


def test_report_says_what_judged_self_prm_beside_the_within_problem_auc(tmp_path):
    md = _report_of(tmp_path, "untrained")
    lines = md.splitlines()
    # Under the held-out heading, with the last version's within-problem AUC.
    at = lines.index("## Held-out evaluation per version")
    assert lines[at + 2] == (
        f"Self-PRM's judge (self_prm@k): **untrained judge**: {UNTRAINED.split(': ', 1)[1]}. "
        "The judge's within-problem AUC (judge_auc_within) at v4: 0.550 [0.450, 0.650] "
        "(0.5 = chance)."
    )
    assert (
        "| k | pass@k | maj@k | self_prm@k (untrained judge) | "
        "self_prm_vs_maj@k (untrained judge) |" in lines
    )
    assert any(
        line.startswith("- self_prm@k: ") and f"Self-judge of this run: {UNTRAINED}." in line
        for line in lines
    )
    # The co-evolution table: the paired difference at k = 8 per version, v0 first.
    head = lines.index(
        "| version | pass@1 | judge_accuracy | judge_auc | judge_auc_within | self_prm_vs_maj@8 "
        "| self_conf_vs_maj@8 |"
    )
    assert lines[head + 2] == (
        "| v0 | 0.250 [0.200, 0.300] | 0.500 [0.450, 0.550] | 0.500 [0.400, 0.600] | – | 0.000 "
        "| – |"
    )
    assert lines[head + 3] == (
        "| v4 | 0.500 [0.400, 0.600] | 0.600 [0.550, 0.650] | 0.700 [0.600, 0.800] | "
        "0.550 [0.450, 0.650] | -0.100 [-0.200, -0.050] | 0.020 [0.010, 0.030] |"
    )


def test_report_labels_a_trained_judge_and_never_calls_it_untrained(tmp_path):
    md = _report_of(tmp_path, "rl_judge_groups")
    assert "Self-PRM's judge (self_prm@k): **trained judge (RL judge groups)**. " in md
    assert "self_prm@k (trained judge (RL judge groups))" in md
    assert "untrained" not in md
