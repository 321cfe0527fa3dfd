"""dags/params.py without a scheduler: the trigger form, config from Params, run URLs."""

from __future__ import annotations

import pytest

from dags.params import TASK_FAMILIES, config_from_params, resolve_root, rl_params, run_url_for
from pipeline.config import ConfigError, load_config
from tests.dags.conftest import ROOT

TINY = {"config_file": "configs/tiny.yaml", "storage_root": "runs"}


@pytest.fixture
def two_families():
    """A shipped config with two families (a config file must lie inside the project)."""
    cfg = load_config(ROOT / "configs/demo_judge.yaml")
    assert cfg.task.families == ("arithmetic", "countdown") and cfg.task.weights == (0.75, 0.25)
    return {"config_file": "configs/demo_judge.yaml", "storage_root": "runs"}


def test_the_form_offers_the_registered_task_families():
    from pipeline.tasks import TASKS

    assert tuple(TASKS) == TASK_FAMILIES
    assert rl_params()["task_families"].schema["items"]["enum"] == list(TASKS)


def test_config_from_params_defaults_are_the_config_file():
    cfg = config_from_params(TINY)
    file_cfg = load_config(ROOT / "configs/tiny.yaml")
    assert cfg.trainer == file_cfg.trainer and cfg.task == file_cfg.task
    assert cfg.storage.root == str(ROOT / "runs")


def test_config_from_params_applies_each_param(two_families):
    cfg = config_from_params(
        {
            **two_families,
            "task_families": ["arithmetic"],
            "model_preset": "demo",
            "algorithm": "grpo",
            "steps": 7,
            "workers": 3,
            "max_staleness": 0,
            "eval_k": 8,
            "overrides": ["trainer.lr=1e-4", "trainer.steps=9"],
        }
    )
    assert cfg.task.families == ("arithmetic",) and cfg.task.weights == (1.0,)
    assert cfg.model.preset == "demo" and cfg.workers == 3
    assert cfg.trainer.max_staleness == 0 and cfg.trainer.lr == 1e-4
    assert cfg.trainer.steps == 9  # free-form overrides come last
    assert cfg.eval.num_samples == 8 and cfg.eval.ks == (1, 8)
    # Same families as the file: its weights are kept.
    same = config_from_params({**two_families, "task_families": ["arithmetic", "countdown"]})
    assert same.task.weights == (0.75, 0.25)
    assert config_from_params({**two_families, "eval_k": 1}).eval.ks == (1,)


def test_config_from_params_refuses_bad_values():
    with pytest.raises(ConfigError, match="trainer.lr"):
        config_from_params({**TINY, "overrides": ["trainer.lr=-1"]})
    with pytest.raises(ConfigError, match="does not exist"):
        config_from_params({**TINY, "config_file": "configs/nope.yaml"})


def test_run_urls():
    assert run_url_for({"run_id": "r1", "storage_root": "gs://b/p/"}, "x") == "gs://b/p/r1"
    assert run_url_for(
        {"run_id": "", "storage_root": "runs"}, "manual__2026-01-05T10:00:00+00:00"
    ) == (f"{ROOT}/runs/airflow-manual__2026-01-05T10-00-00-00-00")
    assert run_url_for({"run_id": "r1", "storage_root": "/abs/runs"}, "x") == "/abs/runs/r1"
    for bad in ({"run_id": "/abs/run"}, {"run_id": ".."}, {"storage_root": "runs/../../etc"}):
        with pytest.raises(ConfigError, match="is invalid; allowed"):
            run_url_for({"run_id": "r1", "storage_root": "runs", **bad}, "x")
    with pytest.raises(ConfigError, match="config_file"):
        config_from_params({**TINY, "config_file": "/etc/passwd.yaml"})
    assert resolve_root("/tmp/x/") == "/tmp/x"


def test_the_dags_schema_choices_are_the_curation_jobs():
    from beam_jobs.schemas import SCHEMAS
    from dags.params import SOURCE_SCHEMAS

    assert list(SOURCE_SCHEMAS) == ["auto", *SCHEMAS]
