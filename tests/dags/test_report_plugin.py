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
