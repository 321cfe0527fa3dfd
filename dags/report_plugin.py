"""The run report inside the Airflow UI: a "Report" tab on every DAG run page.

An Airflow 3 plugin (entry point `airflow.plugins` in pyproject.toml, so every component
with the project installed loads it: `make airflow`, the compose stack, a cluster image):

* a FastAPI app under `/rlax-report` that renders the run's `report/report.md` as HTML,
  with its PNG plots, read through `pipeline.storage` (a run directory or `gs://`), and
  links to the run in MLflow / W&B when `pipeline.tracking` has exported it there;
* an external view with destination `dag_run`: the UI shows it as a tab of each DAG run,
  in an iframe on the same origin, so the UI's session cookie authenticates it.

Which run: the `curate` task of the RLAX training DAGs returns the run's URL (XCom), so
the page works from the moment the run exists and shows the report once the `report` task
has written it. Access: the caller must be allowed to read the DAG's runs (the same check
as `GET /api/v2/dags/{dag_id}/dagRuns/{run_id}`).

Loaded by the API server, not by the DAG processor (`.airflowignore`).
"""

from __future__ import annotations

import html
import re
from typing import Any

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import requires_access_dag
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Response
from fastapi.responses import HTMLResponse

URL_PREFIX = "/rlax-report"
# The DAGs that make an RLAX run, and their task whose XCom return value is its URL. (The
# tab shows on every DAG's runs: Airflow has no per-DAG external views.)
RUN_DAGS = ("rlax_rl_training", "rlax_retraining")
RUN_URL_TASK = "curate"
PLOT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\.png")  # whole names only (fullmatch)

app = FastAPI(title="RLAX run report", docs_url=None, redoc_url=None, openapi_url=None)
can_read_runs = [Depends(requires_access_dag("GET", DagAccessEntity.RUN))]


def run_url_of(session: Any, dag_id: str, run_id: str) -> str | None:
    """The RLAX run URL that DAG run `run_id` of `dag_id` works on, or None."""
    from airflow.models.xcom import XComModel

    if dag_id not in RUN_DAGS:
        return None
    query = XComModel.get_many(
        run_id=run_id,
        dag_ids=dag_id,
        task_ids=RUN_URL_TASK,
        key="return_value",
        map_indexes=-1,
    )
    row = session.scalars(query).first()
    value = XComModel.deserialize_value(row) if row is not None else None
    return value if isinstance(value, str) and value else None


@app.get("/{dag_id}/{run_id}/", response_class=HTMLResponse, dependencies=can_read_runs)
def report_page(dag_id: str, run_id: str, session: SessionDep) -> HTMLResponse:
    from pipeline.report import report_html

    url = run_url_of(session, dag_id, run_id)
    if url is None:
        return HTMLResponse(
            report_html(
                None,
                f"DAG run {run_id} of {dag_id} has no RLAX run (yet). In "
                f"{' and '.join(RUN_DAGS)} the `{RUN_URL_TASK}` task creates the run; this "
                "tab shows its report once the `report` task has written it.",
            )
        )
    return HTMLResponse(run_page(url))


def run_page(url: str) -> str:
    """The page of RLAX run `url`: its report (or a note that there is none yet), with
    links to its tracked runs in MLflow / W&B (`tracking/*/run.json`) when there are any."""
    from pipeline.report import REPORT_KEY, report_html
    from pipeline.storage import open_store
    from pipeline.tracking import tracked_runs

    store = open_store(url)
    tracked = tracked_runs(store)
    if not store.exists(REPORT_KEY):
        note = (
            f"Run `{url}`: no report yet. The `report` task writes it at the end of "
            "the DAG run (after `evaluate`); reload this tab then."
        )
        return report_html(None, note, tracked)
    return report_html(store.read(REPORT_KEY).decode(), f"Run `{url}`", tracked)


@app.get("/{dag_id}/{run_id}/{name}", dependencies=can_read_runs)
def report_plot(dag_id: str, run_id: str, name: str, session: SessionDep) -> Response:
    """One of the report's PNG plots (`report/NAME.png` of the run)."""
    from pipeline.run import REPORT_PREFIX
    from pipeline.storage import open_store

    if not PLOT_NAME.fullmatch(name):
        raise HTTPException(404, f"{html.escape(name)}: only the report's .png plots are served")
    url = run_url_of(session, dag_id, run_id)
    key = f"{REPORT_PREFIX}/{name}"
    store = open_store(url) if url else None
    if store is None or not store.exists(key):
        raise HTTPException(404, f"no plot {name} in this DAG run's report")
    return Response(store.read(key), media_type="image/png")


class RlaxReportPlugin(AirflowPlugin):
    name = "rlax_report"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "RLAX run report"}]
    external_views = [
        {
            "name": "Report",
            # Relative: the UI resolves it against its base URL (behind a proxy too).
            "href": URL_PREFIX.lstrip("/") + "/{DAG_ID}/{RUN_ID}/",
            "destination": "dag_run",
            "url_route": "rlax-report",
        }
    ]
