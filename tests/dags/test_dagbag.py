"""The DAGs as Airflow loads them: no import errors, documented structure, retries, Params."""

from __future__ import annotations

import copy
import re
from datetime import timedelta

import pytest

from tests.dags.conftest import DAGS, ROOT

DAG_IDS = {"rlax_rl_training", "rlax_curation", "rlax_retraining"}


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(str(DAGS))


def test_dagbag_loads_every_dag_without_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) == DAG_IDS


@pytest.mark.parametrize("dag_id", sorted(DAG_IDS))
def test_tags_doc_and_retries_with_backoff(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    assert dag.tags and "rlax" in dag.tags
    assert dag.doc_md and len(dag.doc_md) > 200
    for t in dag.tasks:  # every task runs a job or touches the store: all are "long"
        assert t.retries >= 2, t.task_id
        assert t.retry_exponential_backoff >= 2.0, t.task_id
        assert t.retry_delay >= timedelta(seconds=1), t.task_id
        assert t.max_retry_delay is not None, t.task_id
        assert t.doc_md or t.doc or (t.__doc__ and t.task_id), t.task_id


def _documented_edges(dag_id: str) -> set[tuple[str, str]]:
    """Edges listed in docs/airflow.md between `<!-- structure:DAG_ID -->` markers."""
    text = (ROOT / "docs" / "airflow.md").read_text()
    block = re.search(
        rf"<!-- structure:{dag_id} -->\s*```[a-z]*\n(.*?)```\s*<!-- /structure -->", text, re.S
    )
    assert block, f"docs/airflow.md lacks the structure block of {dag_id}"
    edges = set()
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            up, down = (s.strip() for s in line.split("->"))
            edges.add((up, down))
    return edges


@pytest.mark.parametrize("dag_id", ["rlax_rl_training", "rlax_retraining"])
def test_structure_matches_docs(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    edges = {(up, t.task_id) for t in dag.tasks for up in t.upstream_task_ids}
    assert edges == _documented_edges(dag_id)


def test_rl_training_shape(dagbag):
    dag = dagbag.dags["rlax_rl_training"]
    tasks = dag.task_dict
    assert set(tasks) == {
        "curate",
        "bootstrap",
        "train",
        "rollout_worker",
        "orm",
        "evaluate",
        "report",
    }
    # Workers are one dynamically mapped task, next to (not behind) the trainer.
    assert type(tasks["rollout_worker"]).__name__ == "DecoratedMappedOperator"
    assert "train" not in tasks["rollout_worker"].upstream_task_ids
    assert "rollout_worker" not in tasks["train"].upstream_task_ids
    assert dag.schedule is None  # triggered (UI form, REST API, `rlax demo --airflow`)
    # With the Celery executor the trainer and the workers go to queues of their own
    # (pipeline/queues.py); every other task to the default queue.
    from pipeline.queues import DEFAULT_QUEUE, ROLLOUT_QUEUE, TRAINER_QUEUE

    for dag_id in ("rlax_rl_training", "rlax_retraining"):
        queues = {t.task_id: t.queue for t in dagbag.dags[dag_id].tasks}
        assert queues.pop("train") == TRAINER_QUEUE != ROLLOUT_QUEUE
        assert queues.pop("rollout_worker") == ROLLOUT_QUEUE
        assert set(queues.values()) == {DEFAULT_QUEUE}, queues


def test_retraining_is_weekly_and_one_date_at_a_time(dagbag):
    dag = dagbag.dags["rlax_retraining"]
    assert dag.max_active_runs == 1
    assert not dag.catchup
    assert dag.schedule == "0 3 * * 1"  # weekly, Mondays 03:00 UTC


def test_only_the_scheduled_dag_starts_paused(dagbag):
    """A fresh Airflow runs nothing unasked: the scheduled DAG waits for the user to
    unpause it; the triggered-only ones are ready for the trigger form."""
    for dag_id in DAG_IDS:
        dag = dagbag.dags[dag_id]
        assert dag.is_paused_upon_creation is (dag.schedule is not None), dag_id


@pytest.mark.parametrize("dag_id", ["rlax_rl_training", "rlax_retraining"])
def test_run_outputs_are_assets(dagbag, dag_id):
    tasks = dagbag.dags[dag_id].task_dict
    for task_id, kind in (("train", "weights"), ("evaluate", "eval"), ("report", "report")):
        (asset,) = tasks[task_id].outlets
        assert asset.name == f"{dag_id}.{kind}" and asset.uri == f"x-rlax://{dag_id}/{kind}"


def test_every_default_of_every_dag_validates(dagbag):
    """A trigger that changes nothing passes the API's validation (the trigger form's
    defaults); rlax_curation's input and output have no default on purpose."""
    assert _validate(dagbag.dags["rlax_rl_training"])["config_file"] == "configs/demo.yaml"
    assert _validate(dagbag.dags["rlax_retraining"])["overrides"] is None
    assert (
        _validate(dagbag.dags["rlax_curation"], input=["x.jsonl"], output="out")["beam_args"]
        is None
    )


def _validate(dag, **conf):
    """What the API does with a trigger's conf: the DAG's Params updated, then validated."""
    params = copy.deepcopy(dag.params)
    params.update(conf)
    return params.validate()


def test_params_have_types_descriptions_and_validate(dagbag):
    from airflow.sdk.definitions.param import ParamValidationError

    dag = dagbag.dags["rlax_rl_training"]
    params = dag.params
    expected = {
        "run_id",
        "storage_root",
        "config_file",
        "task_families",
        "source_data",
        "model_preset",
        "hf_checkpoint",
        "lora_rank",
        "algorithm",
        "steps",
        "teacher",
        "teacher_version",
        "distill_coef",
        "workers",
        "max_staleness",
        "eval_k",
        "eval_every",
        "overrides",
    }
    assert set(params.keys()) == expected
    for key in expected:
        param = params.get_param(key)
        assert param.schema.get("type"), key
        assert param.description or param.schema.get("description_md"), key
    ok = _validate(dag, workers=3, steps=10, task_families=["arithmetic"], model_preset="tiny")
    assert ok["workers"] == 3 and ok["task_families"] == ["arithmetic"]
    for bad in (
        {"workers": 0},
        {"workers": 1000},
        {"steps": "ten"},
        {"task_families": ["poetry"]},
        {"model_preset": "huge"},
        {"algorithm": "ppo-ish"},
        {"teacher_version": "newest"},
        {"distill_coef": -0.5},
        {"teacher": "runs/my teacher"},
        {"run_id": "has space"},
        {"run_id": ".."},
        {"run_id": "../outside"},
        {"run_id": "/abs/dir"},
        {"storage_root": "runs/../.."},
        {"config_file": "/etc/passwd"},
        {"config_file": "../configs/demo.yaml"},
        {"overrides": ["not an override"]},
    ):
        with pytest.raises(ParamValidationError):
            _validate(dagbag.dags["rlax_rl_training"], **bad)


def test_curation_params_mirror_the_cli(dagbag):
    from beam_jobs.curate import build_parser

    flags = {a.dest for a in build_parser()._actions if a.option_strings and a.dest != "help"}
    params = set(dagbag.dags["rlax_curation"].params.keys())
    assert flags <= params, flags - params
    assert "beam_args" in params
