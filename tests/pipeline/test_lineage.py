"""Retraining helpers (pipeline/lineage.py) without Airflow: base pinning, chaining, idempotency."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import TaskConfig, load_config
from pipeline.lineage import (
    PIN_KEY,
    LineageError,
    child_url,
    choose_base,
    prepare_child,
    register,
    render_source,
)
from pipeline.paramserver import ParamServer
from pipeline.problem_sets import write_data
from pipeline.run import DONE_KEY, Run
from pipeline.storage import open_store
from pipeline.tasks.arithmetic import ArithmeticOptions
from pipeline.tasks.mix import build_splits
from tests.dags.conftest import ROOT


def _publish(run: Run, values: list[float]) -> None:
    ps = ParamServer(run.store)
    epoch = ps.acquire_epoch()
    for v, value in enumerate(values):
        ps.publish(v, {"w": np.full((2, 3), value, np.float32)}, epoch=epoch)


@pytest.fixture
def parent(tmp_path):
    run = Run.create(str(tmp_path / "parent"), load_config(ROOT / "configs/tiny.yaml"))
    write_data(run)
    _publish(run, [0.0, 1.0, 2.0])
    return run


def _new_problems(families=("arithmetic",), seed=7, n=60):
    cfg = TaskConfig(
        families=families,
        weights=(1.0,) * len(families),
        num_train=n,
        num_eval=5,
        seed=seed,
        arithmetic=ArithmeticOptions(min_digits=2, max_digits=3),
    )
    return build_splits(cfg)[0]


def _write_curated(url: str, problems) -> None:
    """What beam_jobs.curate leaves under OUT/train/ (the Problem columns + extras)."""
    rows = [{**p.to_dict(), "meta": json.dumps(p.meta), "schema": "rlax"} for p in problems]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    open_store(url).child("curated").write_new("train/part-00000-of-00001.parquet", sink.getvalue())


def _tree(path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


PARAMS = {"steps": 3, "workers": 2, "overrides": ["trainer.lr=2e-5"]}


def test_prepare_child_pins_the_parent_snapshot_and_reruns_change_nothing(parent, tmp_path):
    root, ds = str(tmp_path / "retrain"), "2026-01-12"
    url = child_url(root, ds)
    assert url.endswith("/retrain/20260112")
    new = _new_problems()
    _write_curated(url, new)

    child = prepare_child(parent.url, root, ds, PARAMS)
    cfg = child.config
    assert (cfg.trainer.steps, cfg.workers, cfg.trainer.lr) == (3, 2, 2e-5)
    assert cfg.storage.root == root and cfg.model == parent.config.model
    pinned = json.loads(child.store.read(PIN_KEY))
    assert (pinned["run"], pinned["version"], pinned["via"]) == (parent.url, 2, "parent")
    base = ParamServer(child.store.child("base")).pull(0)
    np.testing.assert_array_equal(base.tensors["w"], np.full((2, 3), 2.0, np.float32))
    # Held-out set = the parent's (comparable across weeks); train = the curated rows.
    held_out = [p.problem_id for p in parent.read_problems("eval")]
    assert [p.problem_id for p in child.read_problems("eval")] == held_out
    expected = [p.problem_id for p in new if p.problem_id not in set(held_out)]
    assert [p.problem_id for p in child.read_problems("train")] == expected

    before = _tree(tmp_path / "retrain")
    ParamServer(parent.store).publish(3, {"w": np.full((2, 3), 3.0, np.float32)}, epoch=1)
    again = prepare_child(parent.url, root, ds, PARAMS)  # the same date, re-run later
    assert again.config.digest() == cfg.digest()
    assert _tree(tmp_path / "retrain") == before  # nothing written, base still parent v2


def test_a_week_continues_from_the_newest_earlier_completed_week(parent, tmp_path):
    root = str(tmp_path / "retrain")
    week1 = "2026-01-12"
    _write_curated(child_url(root, week1), _new_problems())
    child1 = prepare_child(parent.url, root, week1, PARAMS)
    _publish(child1, [10.0, 11.0, 12.0, 13.0])  # what its trainer published
    child1.store.write_new(DONE_KEY, json.dumps({"step": 3, "version": 3}).encode())
    record = register(root, week1, child1.url)
    assert (record["run"], record["version"]) == (child1.url, 3)
    assert register(root, week1, child1.url) == record  # create-only

    assert choose_base(parent.url, root, "2026-01-19", chain=True)["run"] == child1.url
    assert choose_base(parent.url, root, "2026-01-19", chain=True)["version"] == 3
    assert choose_base(parent.url, root, "2026-01-19", chain=False)["run"] == parent.url
    # An earlier date (a backfill) never chains from a later week.
    assert choose_base(parent.url, root, "2026-01-05", chain=True)["run"] == parent.url

    _write_curated(child_url(root, "2026-01-19"), _new_problems(seed=8))
    child2 = prepare_child(parent.url, root, "2026-01-19", PARAMS)
    base = ParamServer(child2.store.child("base")).pull(0)
    assert float(base.tensors["w"][0, 0]) == 13.0


def test_errors_name_the_problem(parent, tmp_path):
    root = str(tmp_path / "retrain")
    with pytest.raises(LineageError, match="no run at"):
        prepare_child(str(tmp_path / "nope"), root, "2026-01-12", PARAMS)
    _write_curated(child_url(root, "2026-01-12"), _new_problems(families=("countdown",)))
    only_arith = {**PARAMS, "overrides": ["task.families=[arithmetic]", "task.weights=[1]"]}
    with pytest.raises(ValueError, match="allowed families: arithmetic"):
        prepare_child(parent.url, root, "2026-01-12", only_arith)
    empty = Run.create(str(tmp_path / "empty"), parent.config)
    with pytest.raises(LineageError, match="no published weight version"):
        choose_base(empty.url, root, "2026-01-12", chain=False)


def test_render_source():
    assert render_source("in/{ds}/*.jsonl", "2026-01-05") == "in/2026-01-05/*.jsonl"
    assert render_source("in/{ds_nodash}-*.csv", "2026-01-05") == "in/20260105-*.csv"
