"""dags/common.py without a scheduler: config from Params, run URLs, job processes."""

from __future__ import annotations

import re
import sys

import pytest

from dags.common import (
    BASE_PREFIX,
    TASK_FAMILIES,
    JobFailed,
    JobStopped,
    config_from_params,
    curate_command,
    resolve_root,
    run_url_for,
    stream_command,
    worker_ids,
)
from pipeline.config import ConfigError, load_config
from tests.dags.conftest import ROOT

TINY = {"config_file": "configs/tiny.yaml", "storage_root": "runs"}


@pytest.fixture
def two_families():
    """A shipped config with two families (a config file must lie inside the project)."""
    cfg = load_config(ROOT / "configs/demo_judge.yaml")
    assert cfg.task.families == ("arithmetic", "countdown") and cfg.task.weights == (0.75, 0.25)
    return {"config_file": "configs/demo_judge.yaml", "storage_root": "runs"}


def test_constants_match_the_code_they_mirror():
    from pipeline.tasks import TASKS

    assert set(TASK_FAMILIES) == set(TASKS)
    sft = (ROOT / "tpu_jobs" / "sft.py").read_text()  # importing it would load jax
    assert re.search(rf'^BASE_PREFIX = "{BASE_PREFIX}"$', sft, re.M)


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
    assert worker_ids(2) == ["worker0", "worker1"]


def test_curate_command_mirrors_the_cli():
    cmd = curate_command(
        ["a/*.jsonl", "b/*.csv"],
        "out",
        eval_sets=["e.jsonl"],
        options={"near_dup_threshold": 0.7, "staging": None, "overwrite": True, "x": False},
        beam_args=["--direct_num_workers=2"],
    )
    assert cmd[:3] == [sys.executable, "-m", "beam_jobs.curate"]
    assert cmd[3:] == [
        "--input", "a/*.jsonl", "--input", "b/*.csv", "--output", "out",
        "--eval-sets", "e.jsonl", "--near-dup-threshold", "0.7", "--overwrite",
        "--direct_num_workers=2",
    ]  # fmt: skip
    from beam_jobs.curate import parse_args

    opts = parse_args(cmd[3:])
    assert opts.inputs == ("a/*.jsonl", "b/*.csv") and opts.near_dup_threshold == 0.7
    assert opts.overwrite and opts.beam_args == ("--direct_num_workers=2",)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_stream_command_streams_output_and_fails_with_the_child(capsys):
    lines: list[str] = []
    stream_command(_py("print('hello'); print('world')"), name="ok", capture=lines)
    assert lines == ["hello", "world"]
    assert "hello" in capsys.readouterr().out
    with pytest.raises(JobFailed, match="exited with code 3") as err:
        stream_command(_py("import sys; print('boom'); sys.exit(3)"), name="bad")
    assert err.value.returncode == 3
    with pytest.raises(JobFailed, match="killed by SIGKILL"):
        stream_command(_py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), name="k")


def test_stream_command_stops_the_job_when_asked():
    code = "import signal, sys, time\n"
    code += "signal.signal(signal.SIGTERM, lambda *a: (print('checkpointing'), sys.exit(0)))\n"
    code += "print('up', flush=True)\nwhile True: time.sleep(0.1)\n"
    lines: list[str] = []
    with pytest.raises(JobStopped, match="run aborted"):
        stream_command(
            _py(code),
            name="trainer",
            stop_when=lambda: "run aborted" if lines else None,
            check_every_s=0.2,
            capture=lines,
        )
    assert lines == ["up", "checkpointing"]  # it got SIGTERM (graceful), not SIGKILL


def test_source_data_is_curated_by_beam_into_the_run(tmp_path):
    """The `curate` task's source_data path: the Beam job, then its splits as run data."""
    import json

    from dags.common import local_path, write_curated_data
    from pipeline.config import TaskConfig
    from pipeline.run import Run
    from pipeline.tasks.mix import build_splits

    problems = build_splits(
        TaskConfig(
            families=("arithmetic",), weights=(1.0,), num_train=120, num_eval=5, seed=3,
            min_digits=2, max_digits=3,
        )
    )[0]  # fmt: skip
    src = tmp_path / "src.jsonl"
    rows = [json.dumps(p.to_dict()) for p in problems]
    src.write_text("\n".join(rows + rows[:10]) + "\n")  # 10 exact duplicates
    run = Run.create(str(tmp_path / "run"), config_from_params({**TINY, "eval_k": 2}))
    out = local_path(run.store.url) + "/curated"
    stream_command(curate_command([str(src)], out, options={"val_fraction": 0.1}), name="curate")
    n_train, n_eval = write_curated_data(run)
    assert n_train + n_eval <= len(problems) and n_eval > 0
    ids = {p.problem_id for p in problems}
    train = run.read_problems("train")
    assert {p.problem_id for p in train} <= ids and len(train) == n_train
    assert not {p.problem_id for p in train} & {p.problem_id for p in run.read_problems("eval")}
    assert write_curated_data(run) == (n_train, n_eval)  # a retry: nothing rewritten
