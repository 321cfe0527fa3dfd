"""dags/params.py without a scheduler: the trigger form, config from Params, run URLs."""

from __future__ import annotations

import re

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
            "lora_rank": 8,
            "overrides": ["trainer.lr=1e-4", "trainer.steps=9"],
        }
    )
    assert cfg.lora.rank == 8 and cfg.lora.enabled
    assert cfg.task.families == ("arithmetic",) and cfg.task.weights == (1.0,)
    assert cfg.model.preset == "demo" and cfg.workers == 3
    assert cfg.trainer.max_staleness == 0 and cfg.trainer.lr == 1e-4
    assert cfg.trainer.steps == 9  # free-form overrides come last
    assert cfg.eval.num_samples == 8 and cfg.eval.ks == (1, 8)
    # Same families as the file: its weights are kept.
    same = config_from_params({**two_families, "task_families": ["arithmetic", "countdown"]})
    assert same.task.weights == (0.75, 0.25)
    assert config_from_params({**two_families, "eval_k": 1}).eval.ks == (1,)


def test_config_from_params_sets_the_teacher_and_the_config_checks_the_combination():
    opd = config_from_params(
        {**TINY, "algorithm": "opd", "teacher": "runs/teacher", "teacher_version": "base"}
    )
    assert opd.trainer.algorithm == "opd"
    assert opd.distill.teacher == str(ROOT / "runs/teacher")  # relative: under the project
    assert opd.distill.teacher_version == "base"
    mixed = config_from_params(
        {**TINY, "algorithm": "grpo", "teacher": "gs://b/teacher", "distill_coef": 0.25}
    )
    assert mixed.distill.teacher == "gs://b/teacher" and mixed.distill.teacher_version == "latest"
    assert mixed.trainer.loss_overrides() == {"distill_coef": 0.25}
    # Bad combinations: the config's own checks, one line naming the field.
    for params, field in (
        ({"algorithm": "opd"}, "distill.teacher=''"),
        ({"teacher": "/x/teacher"}, "distill.teacher='/x/teacher'"),
        ({"algorithm": "opd", "teacher": "/x", "distill_coef": 0.5}, "loss.distill_coef=0.5"),
    ):
        with pytest.raises(ConfigError, match=re.escape(field)) as err:
            config_from_params({**TINY, **params})
        assert "\n" not in str(err.value)


def test_config_from_params_refuses_bad_values():
    with pytest.raises(ConfigError, match="trainer.lr"):
        config_from_params({**TINY, "overrides": ["trainer.lr=-1"]})
    # The form cannot know which files exist: the first task refuses it, in one line
    # that names the Param and the project's configs.
    with pytest.raises(ConfigError, match="config_file='configs/nope.yaml': no such file") as err:
        config_from_params({**TINY, "config_file": "configs/nope.yaml"})
    assert "\n" not in str(err.value) and "configs/tiny.yaml" in str(err.value)
    with pytest.raises(ConfigError, match="trainer.nope") as err:
        config_from_params({**TINY, "overrides": ["trainer.nope=1"]})
    assert "\n" not in str(err.value)


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


def _form_required(schema: dict) -> bool:
    """Airflow's trigger form stars a field, and keeps Trigger disabled while it is empty,
    when its JSON-schema type does not include null (the UI's rule, airflow/ui)."""
    types = schema.get("type")
    return bool(types) and not (isinstance(types, list) and "null" in types)


def test_every_default_submits_and_makes_the_demo_config():
    """The form left as it is: every starred field has a value, the defaults validate as
    the API validates a trigger, and they make configs/demo.yaml's run."""
    from airflow.sdk.definitions.param import ParamsDict

    params = rl_params()
    for name, param in params.items():
        if _form_required(param.schema):
            assert param.value not in (None, "", []), f"{name} is starred and empty"
    resolved = ParamsDict(params).validate()  # raises as the API's 400 would
    assert resolved["run_id"] is None and resolved["overrides"] is None
    cfg = config_from_params(resolved)
    demo = load_config(ROOT / "configs/demo.yaml")
    assert cfg.trainer == demo.trainer and cfg.model == demo.model and cfg.eval == demo.eval
    assert run_url_for(resolved, "manual__x").endswith("/runs/airflow-manual__x")


def test_dropdowns_label_the_empty_choice_and_bounds_are_declared():
    params = rl_params()
    for name in ("model_preset", "algorithm"):
        schema = params[name].schema
        assert schema["enum"][0] is None and None not in schema["enum"][1:], name
        # The form shows values_display["null"] for the empty choice, not "null".
        assert schema["values_display"]["null"] == "(the config file's)", name
    for name in ("steps", "workers", "max_staleness", "eval_k", "eval_every", "lora_rank"):
        schema = params[name].schema
        assert schema["minimum"] <= schema["maximum"], name
        assert f"{schema['minimum']} to {schema['maximum']:,}" in params[name].description
    assert params["workers"].schema["maximum"] == 16
    for name in ("run_id", "storage_root", "config_file", "source_data", "hf_checkpoint"):
        assert params[name].schema["pattern"], name
    assert "configs/tiny.yaml" in params["config_file"].schema["examples"]


@pytest.mark.parametrize(
    ("name", "value", "ok"),
    [
        ("run_id", None, True),
        ("run_id", "", True),
        ("run_id", "my-run_1.2", True),
        ("run_id", "my run", False),
        ("run_id", "-x", False),
        ("run_id", "a" * 129, False),
        ("workers", 16, True),
        ("workers", 17, False),
        ("workers", 0, False),
        ("max_staleness", 0, True),
        ("lora_rank", 0, True),
        ("lora_rank", 64, True),
        ("lora_rank", -1, False),
        ("lora_rank", 4097, False),
        ("eval_every", 0, False),
        ("model_preset", None, True),
        ("model_preset", "tiny", True),
        ("model_preset", "null", False),
        ("algorithm", "grpo", True),
        ("algorithm", "opd", True),  # the presets' list
        ("teacher", None, True),
        ("teacher", "gs://b/runs/teacher", True),
        ("teacher", "runs/my teacher", False),
        ("teacher_version", None, True),
        ("teacher_version", "latest", True),
        ("teacher_version", "base", True),
        ("teacher_version", "12", True),
        ("teacher_version", "v12", False),
        ("distill_coef", None, True),
        ("distill_coef", 0.5, True),
        ("distill_coef", -0.1, False),
        ("source_data", "data/x y.jsonl", False),
        ("source_data", "gs://b/p/*.jsonl", True),
        ("hf_checkpoint", None, True),
        ("overrides", None, True),
        ("overrides", ["trainer.lr=1e-4"], True),
        ("overrides", ["lr 1e-4"], False),
        ("config_file", "configs/tiny.yaml", True),
        ("config_file", "configs/tiny.json", False),
    ],
)
def test_one_param_against_its_schema(name, value, ok):
    from airflow.sdk.definitions.param import ParamValidationError

    param = rl_params()[name]
    if ok:
        assert param.resolve(value) == value
    else:
        with pytest.raises(ParamValidationError):
            param.resolve(value)
