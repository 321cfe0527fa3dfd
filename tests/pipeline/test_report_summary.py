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
        {"batch_index": 0, "committed": True, "generate_s": 4.0, "tool_s": 1.5},
        {"batch_index": 1, "committed": True, "generate_s": 5.0, "tool_s": 0.5},
        {"batch_index": 2, "committed": True, "seconds": 3.0},  # a single-turn batch
    ]
    assert time_split(train, rollouts) == [
        {"step": 1, "generate_s": 4.0, "tool_s": 1.5, "train_s": 2.0},
        {"step": 2, "generate_s": 5.0, "tool_s": 0.5, "train_s": 3.0},
    ]
