"""A run's problem sets: synthetic, or a Beam curation's splits (`pipeline.problem_sets`)."""

from __future__ import annotations

import json
import subprocess

from dags.params import config_from_params
from pipeline.entrypoint import BAD_INPUT
from pipeline.layout import CURATED_PREFIX
from pipeline.ops import launcher
from pipeline.problem_sets import write_curated_data
from pipeline.run import Run

TINY = {"config_file": "configs/tiny.yaml", "storage_root": "runs"}


def _problems(n: int, seed: int = 3):
    from pipeline.config import TaskConfig
    from pipeline.tasks.arithmetic import ArithmeticOptions
    from pipeline.tasks.mix import build_splits

    return build_splits(
        TaskConfig(
            families=("arithmetic",), weights=(1.0,), num_train=n, num_eval=5, seed=seed,
            arithmetic=ArithmeticOptions(min_digits=2, max_digits=3),
        )
    )[0]  # fmt: skip


def _data_job(run: Run, *extra: str) -> subprocess.CompletedProcess:
    cmd = launcher.job_command("data", run.url, extra)
    return subprocess.run(cmd, capture_output=True, text=True, env=launcher.job_env())


def test_source_data_is_curated_by_beam_into_the_run(tmp_path):
    """The `curate` task's source_data path: the Beam job, then its splits as run data."""
    problems = _problems(120)
    src = tmp_path / "src.jsonl"
    rows = [json.dumps(p.to_dict()) for p in problems]
    src.write_text("\n".join(rows + rows[:10]) + "\n")  # 10 exact duplicates
    run = Run.create(str(tmp_path / "run"), config_from_params({**TINY, "eval_k": 2}))
    out = run.store.url_of(CURATED_PREFIX)
    launcher.stream(
        launcher.curate_command([str(src)], out, options={"val_fraction": 0.1}), name="curate"
    )
    n_train, n_eval = write_curated_data(run)
    assert n_train + n_eval <= len(problems) and n_eval > 0
    ids = {p.problem_id for p in problems}
    train = run.read_problems("train")
    assert {p.problem_id for p in train} <= ids and len(train) == n_train
    assert not {p.problem_id for p in train} & {p.problem_id for p in run.read_problems("eval")}
    assert write_curated_data(run) == (n_train, n_eval)  # a retry: nothing rewritten

    # The same curated data in a run without an arithmetic verifier: the data job refuses
    # it with BAD_INPUT (the DAG task then fails for good), naming the family.
    other = Run.create(
        str(tmp_path / "countdown-run"),
        config_from_params({**TINY, "task_families": ["countdown"]}),
    )
    for key in run.store.list(f"{CURATED_PREFIX}/"):
        other.store.write_new(key, run.store.read(key))
    done = _data_job(other, "--curated")
    assert done.returncode == BAD_INPUT, done.stdout + done.stderr
    assert "of task families {'arithmetic':" in done.stdout and "no verifier" in done.stdout
    assert not other.has_problems("train") and not other.has_problems("eval")


def test_the_data_job_writes_synthetic_problems_once(tmp_path):
    run = Run.create(str(tmp_path / "run"), config_from_params(TINY))
    first = _data_job(run)
    assert first.returncode == 0, first.stdout + first.stderr
    cfg = run.config.task
    assert f"{cfg.num_train} training and {cfg.num_eval} held-out" in first.stdout
    train = run.store.read(run.data_key("train"))
    assert _data_job(run).returncode == 0
    assert run.store.read(run.data_key("train")) == train  # a retry rewrites nothing
