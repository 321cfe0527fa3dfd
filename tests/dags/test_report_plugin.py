"""dags/report_plugin.py as Airflow finds it (the page itself: tests/ui, in a browser)."""

from __future__ import annotations

from importlib.metadata import entry_points


def test_the_plugin_is_registered_and_adds_a_dag_run_tab():
    from airflow.plugins_manager import is_valid_plugin

    (ep,) = [e for e in entry_points(group="airflow.plugins") if e.name == "rlax_report"]
    plugin = ep.load()
    assert is_valid_plugin(plugin)
    (view,) = plugin.external_views
    assert view["destination"] == "dag_run" and view["name"] == "Report"
    # Relative (the UI resolves it against its base URL), with the run's placeholders.
    assert view["href"] == "rlax-report/{DAG_ID}/{RUN_ID}/"
    (app,) = plugin.fastapi_apps
    assert app["url_prefix"] == "/rlax-report"
    paths = {route.path for route in app["app"].routes}
    assert {"/{dag_id}/{run_id}/", "/{dag_id}/{run_id}/{name}"} <= paths


def test_only_the_reports_plots_are_served():
    from dags.report_plugin import PLOT_NAME

    for ok in ("curves.png", "metrics_vs_k.png", "judge-buckets.png"):
        assert PLOT_NAME.fullmatch(ok), ok
    for bad in ("../config.json", "report.md", "..png", "a/b.png", "x.png\n", ".png"):
        assert not PLOT_NAME.fullmatch(bad), bad


def test_the_report_page_links_to_the_runs_tracked_runs(tmp_path):
    import json

    from dags.report_plugin import run_page
    from pipeline.run import Run
    from pipeline.tracking import run_key
    from tests.runs import tiny_config

    run = Run.create(str(tmp_path / "run"), tiny_config())
    assert "Tracked:" not in run_page(run.url)  # nothing exported to a tracker yet
    mlflow_url = "http://127.0.0.1:5000/#/experiments/1/runs/abc&d"
    run.store.write_new(
        run_key("mlflow"),
        json.dumps({"sink": "mlflow", "run_id": "abc", "url": mlflow_url}).encode(),
    )
    run.store.write_new(run_key("wandb"), json.dumps({"sink": "wandb", "run_id": "w1"}).encode())
    page = run_page(run.url)
    assert "no report yet" in page
    link = (
        '<a href="http://127.0.0.1:5000/#/experiments/1/runs/abc&amp;d" target="_blank" '
        'rel="noopener">MLflow run abc</a>'
    )
    assert link in page
    assert "Weights &amp; Biases run w1 (no web page: offline)" in page
    run.store.write_new("report/report.md", b"# the report")
    page = run_page(run.url)
    assert link in page and "<h1>the report</h1>" in page
    # A URL that is not http(s) is never made a link.
    run2 = Run.create(str(tmp_path / "run2"), tiny_config())
    bad = {"sink": "mlflow", "run_id": "x", "url": "javascript:alert(1)"}
    run2.store.write_new(run_key("mlflow"), json.dumps(bad).encode())
    assert "<a " not in run_page(run2.url)
