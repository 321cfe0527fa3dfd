"""pipeline/tracking.py against real trackers: an `mlflow server` (SQLite backend) on
127.0.0.1 read back through MLflow's client, and W&B offline run files read back with
`wandb leet inspect --json`. Every metric is compared, exactly, with the run's records."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import ConfigError, override_section
from pipeline.net import free_port
from pipeline.run import DONE_KEY, Run, weights_server
from pipeline.tracking import (
    Exporter,
    export,
    flat_params,
    run_key,
    tracked_runs,
)
from tests.runs import inspect_wandb, tiny_config

BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def offline_trackers(tmp_path, monkeypatch):
    """Nothing leaves the machine: no telemetry, W&B offline with its files in tmp."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` (SQLite backend, served artifacts) on a free 127.0.0.1 port, started
    as `rlax stack up --mlflow` starts it (pipeline/ops/stack.py), stopped afterwards."""
    from pipeline.ops.stack import SERVICES_BY_NAME, Stack

    stack = Stack(root=tmp_path_factory.mktemp("stack"), log=lambda m: None)
    try:
        stack.start(SERVICES_BY_NAME["mlflow"], timeout=300)
        yield stack.mlflow_url
    finally:
        stack.stop("mlflow")


# -- a run's records ---------------------------------------------------------------------


def ci(mean: float, lo: float, hi: float) -> dict[str, float]:
    return {"mean": mean, "lo": lo, "hi": hi}


def plant(run: Run, steps: range, versions: range, batches: range) -> None:
    """Records shaped as the roles write them (trainer step, rollout attempts with a
    discarded duplicate, evaluator summaries with intervals and judge statistics)."""
    for s in steps:
        run.log_metrics(
            "train",
            s,
            {
                "step": s,
                "batch_index": s - 1,
                "reward_mean": 0.1 * s + 0.01,
                "loss": -0.25 * s,
                "kl": 0.003 * s,
                "staleness": s % 2,
                "staleness_hist": {"0": s, "1": s // 2},
                "policy_version": s - 1,
                "step_s": 1.5 + s,
            },
        )
    for v in versions:
        p1 = 0.2 + 0.05 * v
        record = {
            "version": v,
            "num_problems": 8,
            "num_samples": 4,
            "metrics": {
                "pass@1": ci(p1, p1 - 0.1, p1 + 0.1),
                "pass@4": ci(0.5 + 0.01 * v, 0.3, 0.7),
                "maj@4": ci(0.375, 0.125, 0.625),
                "self_prm@4": ci(0.4 + 0.02 * v, 0.2, 0.6),
            },
            "per_task": {"arithmetic": {"pass@1": ci(p1, 0.0, 0.5)}},
            "complete": True,  # not a number: no metric
        }
        run.log_metrics("eval", v, record)
    for b in batches:
        for committed in (True, False):  # the second attempt lost the create-only race
            rec = {
                "batch_index": b,
                "worker_id": "w0" if committed else "w1",
                "committed": committed,
                "policy_version": b,
                "tokens": 100 + b,
                "reward_mean": 0.5 if committed else 0.0,
                "seconds": 0.25,
            }
            key = f"metrics/rollout/b{b:08d}-{uuid.uuid4().hex[:12]}.json"
            run.store.write_new(key, json.dumps(rec, sort_keys=True).encode())


def publish(run: Run, version: int) -> None:
    ps = weights_server(run)
    ps.publish(version, {"w": np.full(3, version, np.float32)}, epoch=ps.acquire_epoch())


def expected(run: Run) -> dict[str, set[tuple[int, float]]]:
    """{tag: {(x, value)}} written out by hand from the records, per stream, as the
    trackers should show them (TensorBoard's tags: "@" -> "_at_")."""
    out: dict[str, set[tuple[int, float]]] = {}

    def add(tag, x, v):
        out.setdefault(tag, set()).add((x, float(v)))

    for r in run.read_metrics("train"):
        s = r["step"]
        for f in ("batch_index", "reward_mean", "loss", "kl", "staleness", "policy_version"):
            add(f"train/{f}", s, r[f])
        add("train/step_s", s, r["step_s"])
        for k, v in r["staleness_hist"].items():
            add(f"train/staleness_hist/{k}", s, v)
    for r in run.read_metrics("eval"):
        v = r["version"]
        add("eval/num_problems", v, r["num_problems"])
        add("eval/num_samples", v, r["num_samples"])
        for name, m in r["metrics"].items():
            tag = "eval/" + name.replace("@", "_at_")
            add(tag, v, m["mean"])
            add(f"{tag}/lo", v, m["lo"])
            add(f"{tag}/hi", v, m["hi"])
        m = r["per_task"]["arithmetic"]["pass@1"]
        add("eval/per_task/arithmetic/pass_at_1", v, m["mean"])
        add("eval/per_task/arithmetic/pass_at_1/lo", v, m["lo"])
        add("eval/per_task/arithmetic/pass_at_1/hi", v, m["hi"])
    for r in run.read_metrics("rollout"):
        if r["committed"]:  # the discarded attempt is no batch of the run
            b = r["batch_index"]
            for f in ("batch_index", "policy_version", "tokens", "reward_mean", "seconds"):
                add(f"rollout/{f}", b, r[f])
    return out


def new_run(tmp_path: Path, *overrides: str) -> Run:
    return Run.create(str(tmp_path / "run"), tiny_config(*overrides))


# -- MLflow ------------------------------------------------------------------------------


def mlflow_points(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    keys = client.get_run(run_id).data.metrics
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in keys}


def assert_same_points(got: dict[str, list[tuple[int, float]]], want: dict) -> None:
    assert set(got) == set(want)
    for tag, points in got.items():
        assert len(points) == len(set(points)), f"{tag}: a point logged twice: {points}"
        assert set(points) == want[tag], tag


def test_mlflow_gets_config_metrics_report_and_version_and_a_resume_continues_it(
    tmp_path, mlflow_server
):
    from mlflow.tracking import MlflowClient

    from pipeline.report import build_report

    experiment = f"exp-{uuid.uuid4().hex[:8]}"
    run = new_run(
        tmp_path,
        "tracking.backends=[tensorboard,mlflow]",
        f"tracking.mlflow_uri={mlflow_server}",
        f"tracking.experiment={experiment}",
    )
    plant(run, steps=range(1, 4), versions=range(0, 2), batches=range(0, 3))
    publish(run, 0)
    build_report(run)  # the report job: writes the report, then feeds the trackers

    (tracked,) = tracked_runs(run.store)
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name(experiment)
    assert tracked.sink == "mlflow" and tracked.url == (
        f"{mlflow_server}/#/experiments/{exp.experiment_id}/runs/{tracked.run_id}"
    )
    got = client.get_run(tracked.run_id)
    assert got.data.tags["rlax.run"] == run.url and got.data.tags["weight_version"] == "0"
    params = got.data.params
    assert params["trainer.lr"] == str(run.config.trainer.lr)
    assert json.loads(params["task.families"]) == list(run.config.task.families)
    assert params["tracking.mlflow_uri"] == mlflow_server
    assert len(params) == len(flat_params(run.config.to_dict()))
    assert_same_points(mlflow_points(client, tracked.run_id), expected(run))
    names = {a.path for a in client.list_artifacts(tracked.run_id, "report")}
    assert {"report/report.md", "report/curves.png"} <= names
    local = client.download_artifacts(tracked.run_id, "report/report.md", str(tmp_path / "dl"))
    assert Path(local).read_bytes() == run.store.read("report/report.md")
    # TensorBoard, the default backend, is still fed beside it.
    assert list((tmp_path / "run" / "tensorboard" / "train").glob("events.out.tfevents.*"))

    # Preempted and resumed: more records and a new version, a new exporter process.
    plant(run, steps=range(4, 6), versions=range(2, 3), batches=range(3, 4))
    publish(run, 1)
    logs: list[str] = []
    # 2 train + 1 eval + 2 rollout attempts; TensorBoard rewrites its files from all 16.
    assert export(run, log=logs.append) == {"tensorboard": 16, "mlflow": 5}
    assert export(run, log=logs.append)["mlflow"] == 0  # ... and, again, nothing
    assert tracked_runs(run.store) == [tracked]
    assert len(client.search_runs([exp.experiment_id])) == 1
    assert_same_points(mlflow_points(client, tracked.run_id), expected(run))
    assert client.get_run(tracked.run_id).data.tags["weight_version"] == "1"
    assert client.get_run(tracked.run_id).info.status == "RUNNING"
    run.store.write_new(DONE_KEY, b"{}")
    export(run, log=logs.append)
    assert client.get_run(tracked.run_id).info.status == "FINISHED"
    assert not [m for m in logs if "failed" in m], logs


def test_a_failing_tracker_is_logged_once_never_raises_and_is_retried_later(
    tmp_path, mlflow_server, monkeypatch
):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    run = new_run(tmp_path)
    plant(run, steps=range(1, 3), versions=range(0, 1), batches=())
    down = override_section(
        run.config.tracking,
        "tracking",
        [
            "tracking.backends=[mlflow,tensorboard]",
            f"tracking.mlflow_uri=http://127.0.0.1:{free_port()}",
        ],
    )
    logs: list[str] = []
    ex = Exporter(run, down, log=logs.append)
    try:
        assert ex.sync() == {"mlflow": 0, "tensorboard": 3}  # TensorBoard got everything
        assert ex.sync() == {"mlflow": 0, "tensorboard": 0}
    finally:
        ex.close()
    failed = [m for m in logs if "failed" in m]
    assert len(failed) == 1 and failed[0].startswith("[tracking] mlflow failed:"), logs
    assert not run.store.exists(run_key("mlflow"))  # no tracked run, nothing marked exported
    # The tracker is back (here: the right URI): the next export sends everything.
    up = override_section(down, "tracking", [f"tracking.mlflow_uri={mlflow_server}"])
    assert export(run, up, log=logs.append) == {"mlflow": 3, "tensorboard": 3}
    (tracked,) = tracked_runs(run.store)
    client = MlflowClient(tracking_uri=mlflow_server)
    assert_same_points(mlflow_points(client, tracked.run_id), expected(run))


# -- Weights & Biases (offline) ----------------------------------------------------------


def test_wandb_offline_files_hold_the_records_and_a_resume_continues_the_same_run(tmp_path):
    from pipeline.report import build_report

    wandb_dir = tmp_path / "wb"
    run = new_run(
        tmp_path,
        "tracking.backends=[wandb]",
        "tracking.wandb_mode=offline",
        f"tracking.wandb_dir={wandb_dir}",
    )
    plant(run, steps=range(1, 3), versions=range(0, 2), batches=range(0, 2))
    publish(run, 0)
    build_report(run)
    (tracked,) = tracked_runs(run.store)
    assert tracked.sink == "wandb" and tracked.url == ""  # offline: no web page yet
    plant(run, steps=range(3, 4), versions=range(2, 3), batches=range(2, 3))
    publish(run, 1)
    assert export(run, log=print) == {"wandb": 4}  # 1 train, 1 eval, 2 rollout attempts
    assert export(run, log=print) == {"wandb": 0}

    files = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 3  # one per exporter process (report, two exports): one run id
    got: dict[str, list[tuple[int, float]]] = {}
    axes = {"train": "train/step", "eval": "eval/version", "rollout": "rollout/batch_index"}
    config, tags, artifacts, summary = {}, [], [], {}
    for f in files:
        assert f.name == f"run-{tracked.run_id}.wandb"
        for rec in inspect_wandb(f):
            kind = rec["type"]
            if kind == "history":
                item = rec["history"]["item"]
                for tag, value in item.items():
                    stream = tag.split("/", 1)[0]
                    if tag.startswith("_") or tag in ("train/step", "eval/version"):
                        continue  # W&B's own fields, and the x axes that are no record field
                    got.setdefault(tag, []).append((int(item[axes[stream]]), float(value)))
            elif kind == "run":
                assert rec["run"]["run_id"] == tracked.run_id
                config.update(rec["run"].get("config", {}).get("update", {}))
                tags = rec["run"].get("tags", tags)
            elif kind == "artifact":
                artifacts.append(rec["artifact"])
            elif kind == "summary":
                summary.update(rec["summary"].get("update", {}))
    assert_same_points(got, expected(run))
    assert config["trainer.lr"] == str(run.config.trainer.lr)
    assert summary["weight_version"] == 1 and "weight_version=1" in tags
    names = {c["path"] for a in artifacts for c in a["manifest"]["contents"]}
    assert {"report/report.md", "report/curves.png"} <= names


# -- config and plumbing -----------------------------------------------------------------


def test_tracking_config_refuses_what_it_cannot_use():
    for bad, field in (
        ("tracking.backends=[nope]", "tracking.backends"),
        ("tracking.backends=[wandb,wandb]", "tracking.backends"),
        ("tracking.backends=[mlflow]", "tracking.mlflow_uri"),  # no URI
        ("tracking.mlflow_uri=localhost:5000", "tracking.mlflow_uri"),
        ("tracking.wandb_mode=sometimes", "tracking.wandb_mode"),
    ):
        with pytest.raises(ConfigError, match=rf"^{field}=.*allowed: "):
            tiny_config(bad)
    assert tiny_config().tracking.backends == ("tensorboard",)
    cfg = tiny_config().tracking
    assert override_section(cfg, "tracking", ["tracking.backends=[]"]).backends == ()
    with pytest.raises(ConfigError, match="only tracking"):
        override_section(cfg, "tracking", ["trainer.lr=1"])


def test_flat_params_are_dotted_with_lists_as_json():
    tree = {"a": 1, "b": {"c": [1, 2], "d": {"e": "x"}}, "f": (3,)}
    assert flat_params(tree) == {"a": "1", "b.c": "[1, 2]", "b.d.e": "x", "f": "[3]"}


def test_the_track_command_is_wired():
    from pipeline.ops.cli import build_parser

    args = build_parser().parse_args(
        ["track", "--run", "runs/x", "--follow", "tracking.backends=[mlflow]"]
    )
    assert args.follow and args.overrides == ["tracking.backends=[mlflow]"]
    assert args.func.__name__ == "cmd_track"
