r"""Experiment trackers fed from the run's own metrics records: TensorBoard, MLflow, W&B.

    rlax track --run RUN [--follow] [tracking.backends=[mlflow] tracking.mlflow_uri=URI]

The trainer, rollout workers and evaluators only write their immutable records
(`metrics/{stream}/...json`); one exporter reads them and feeds every backend of the run's
`tracking` section (`TrackingConfig`, below), so no training process holds
tracker credentials and a tracker that is down never slows or fails training. The
exporter runs where `tb_export` always ran: in the `report` job (the Airflow DAG's
`report` task, `rlax report`, the demo's last stage) and from `rlax track --follow`.

Each backend is a `Sink` in `SINKS`, the one registry (`tracking.backends` is checked
against it). A tracker sink (MLflow, W&B) logs:

- the resolved run config as parameters (flattened, `trainer.lr`), once, when it creates
  the tracked run;
- every numeric leaf of every record (`tb_export.scalars`, the same tags as TensorBoard):
  per trainer step (`train/`, `sft/`, `orm_train/`), per rollout batch (`rollout/`, the
  committed attempt of each batch), per weight version (`eval/`, `eval-n{n}-k...`:
  pass@k, maj@k, self_prm@k, with `tag/lo` and `tag/hi` their 95% interval);
- the newest published weight version as the tag `weight_version`;
- `report/report.md` and its plots as artifacts under `report/`, again whenever they change.

Preemption: the tracked run's id lives in the bucket, `tracking/{sink}/run.json`, written
create-only, so a resumed exporter (or a second one racing it) continues the same tracked
run; `tracking/{sink}/cursor.json` (compare-and-swap) lists the record keys already
logged, so an export that is repeated or resumed logs nothing twice. A record is marked
exported only after the tracker accepted it: a crash in between logs it again on the next
export (MLflow's server drops such exact duplicates, as every record but a rollout
attempt carries its write time; W&B would show the point twice).

A failing sink is logged once (until it recovers) and retried on the next pass or export;
it never fails the report or training. mlflow, wandb and tensorboardX are imported inside
the sinks only, so this module stays light (the config and the Airflow plugin import it).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.errors import check as _check
from pipeline.errors import one_of as _one_of
from pipeline.layout import DONE_KEY, METRICS_PREFIX, REPORT_PREFIX, TRACKING_PREFIX
from pipeline.tb_export import RunRecords

if TYPE_CHECKING:
    from pipeline.storage import ObjectStore


class _RunSettings(Protocol):
    """The part of a run's config the exporter reads (`pipeline.config.RunConfig` is one)."""

    tracking: TrackingConfig

    def to_dict(self) -> dict[str, Any]: ...


class TrackedSource(RunRecords, Protocol):
    """What the exporter and its sinks read of a run (`pipeline.run.Run` is one): its URL,
    store and config. A protocol, not Run itself: pipeline.run imports the config, which
    composes `TrackingConfig` from this module, so importing Run here would close a loop."""

    url: str
    config: _RunSettings


Log = Callable[[str], None]
MLFLOW_BATCH = 1000  # metrics per log_batch call (the server's MAX_METRICS_PER_BATCH)
MLFLOW_PARAMS_BATCH = 100  # params per log_batch call (MAX_PARAMS_TAGS_PER_BATCH)
WEIGHT_TAG = "weight_version"


@dataclasses.dataclass(frozen=True)
class TrackedRun:
    """A run in a tracker: its id there and, when the tracker has a web UI, its page."""

    sink: str
    run_id: str
    url: str = ""


@dataclasses.dataclass(frozen=True)
class Point:
    """One scalar of one record: `tag` at x `step`, written at `time` (seconds)."""

    stream: str
    tag: str
    step: int
    value: float
    time: float


def run_key(sink: str) -> str:
    return f"{TRACKING_PREFIX}/{sink}/run.json"


def cursor_key(sink: str) -> str:
    return f"{TRACKING_PREFIX}/{sink}/cursor.json"


def tracked_runs(store: ObjectStore) -> list[TrackedRun]:
    """The tracked runs recorded under a run's `tracking/` (for links: the Airflow plugin)."""
    out = []
    for key in store.list(f"{TRACKING_PREFIX}/"):
        if key.endswith("/run.json"):
            out.append(TrackedRun(**json.loads(store.read(key))))
    return out


def flat_params(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config dict as {"section.field": "value"} (lists and tuples as JSON)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, list | tuple) else str(value)
    return out


def record_points(stream: str, record: dict[str, Any], when: float) -> list[Point]:
    """Every scalar of a record as Points, tagged and placed on x as in TensorBoard."""
    from pipeline.tb_export import scalars, tb_tag, x_value

    step = x_value(stream, record)
    wall = float(record.get("time", when))
    return [Point(stream, tb_tag(t), step, v, wall) for t, v in scalars(stream, record)]


def exported_record(stream: str, record: dict[str, Any]) -> bool:
    """Whether a record goes to the trackers: every record but the rollout attempts whose
    batch another worker committed (wasted work, counted in the report, not a batch)."""
    return stream != "rollout" or bool(record.get("committed", True))


# -- the sinks ---------------------------------------------------------------------------


class Sink(abc.ABC):
    """A backend. `sync()` logs what is new and returns how many records it logged."""

    name = ""

    def __init__(self, run: TrackedSource, cfg: TrackingConfig, log: Log) -> None:
        self.run, self.cfg, self.log = run, cfg, log

    @abc.abstractmethod
    def sync(self) -> int:
        """Log the records not logged yet; return how many."""

    def close(self) -> None:  # noqa: B027 (an optional hook: nothing to release by default)
        """Flush and release the backend (the tracked run continues on the next export)."""


class TensorBoardSink(Sink):
    """Today's behaviour (`pipeline.tb_export`): event files in `{run}/tensorboard/` of a
    local run, rewritten from the records by each exporter (TensorBoard files are local)."""

    name = "tensorboard"

    def __init__(self, run: TrackedSource, cfg: TrackingConfig, log: Log) -> None:
        super().__init__(run, cfg, log)
        self._exporter = None

    def sync(self) -> int:
        from pipeline.tb_export import Exporter, local_logdir

        if self._exporter is None:
            logdir = local_logdir(self.run)
            if logdir is None:
                return 0  # a gs:// run: `rlax tensorboard --run RUN --logdir DIR`
            self._exporter = Exporter(self.run, logdir, log=self.log)
            self._exporter.reset()
        return self._exporter.sync()

    def close(self) -> None:
        if self._exporter is not None:
            self._exporter.close()


class TrackerSink(Sink):
    """A tracker with runs of its own: the run id in the bucket (create-only), a cursor of
    the exported record keys (compare-and-swap), the report as artifacts. Subclasses say
    how to create, resume and log."""

    def __init__(self, run: TrackedSource, cfg: TrackingConfig, log: Log) -> None:
        super().__init__(run, cfg, log)
        self.tracked: TrackedRun | None = None

    # What a tracker implements.
    @abc.abstractmethod
    def create(self, params: dict[str, str]) -> TrackedRun:
        """A new tracked run with these parameters (or only its id, where the tracker
        creates it on `attach`)."""

    @abc.abstractmethod
    def attach(self, tracked: TrackedRun, params: dict[str, str] | None) -> None:
        """Log to `tracked` from now on; `params` when this exporter just created it."""

    def discard(self, tracked: TrackedRun) -> None:
        """Remove a run this exporter created but lost the create-only race for."""

    @abc.abstractmethod
    def log_points(self, points: list[Point]) -> None:
        """Log metric points to the attached run."""

    @abc.abstractmethod
    def set_weight_version(self, version: int) -> None:
        """Tag the attached run with the newest weight version."""

    @abc.abstractmethod
    def log_report(self, files: dict[str, Path]) -> None:
        """Log `report/` files (name -> local file) as artifacts."""

    def finish(self) -> None:
        """The trainer is done and everything is exported: mark the tracked run finished."""

    # The shared protocol.
    def _open(self) -> TrackedRun:
        store, key = self.run.store, run_key(self.name)
        params = None
        if not store.exists(key):
            params = flat_params(self.run.config.to_dict())
            mine = self.create(params)
            if not store.write_new(key, json.dumps(dataclasses.asdict(mine)).encode()):
                self.discard(mine)  # another exporter created the tracked run first: use it
                params = None
        tracked = TrackedRun(**json.loads(store.read(key)))
        self.attach(tracked, params)
        return tracked

    def _read_cursor(self) -> tuple[dict[str, Any], int | None]:
        got = self.run.store.read_versioned(cursor_key(self.name))
        if got is None:
            return {"streams": {}, "report": {}, WEIGHT_TAG: None}, None
        return json.loads(got[0]), got[1]

    def _write_cursor(self, cursor: dict[str, Any], generation: int | None) -> None:
        data = json.dumps(cursor, sort_keys=True).encode()
        if not self.run.store.compare_and_swap(cursor_key(self.name), data, generation):
            raise RuntimeError(
                f"{self.run.store.url_of(cursor_key(self.name))} changed while exporting: run "
                "one exporter per run (`rlax track --follow` or the report task)"
            )

    def _new_records(self, done: dict[str, list[str]]) -> Iterator[tuple[str, str, dict]]:
        for key in self.run.store.list(f"{METRICS_PREFIX}/"):
            parts = key.split("/")
            if len(parts) != 3 or not key.endswith(".json"):
                continue
            stream, name = parts[1], parts[2][: -len(".json")]
            if name not in done.get(stream, ()):
                yield stream, name, json.loads(self.run.store.read(key))

    def sync(self) -> int:
        if self.tracked is None:
            self.tracked = self._open()
        cursor, generation = self._read_cursor()
        done = {s: set(names) for s, names in cursor["streams"].items()}
        trainer_done = self.run.store.exists(DONE_KEY)
        now, points, new = time.time(), [], {}
        for stream, name, record in self._new_records(done):
            if exported_record(stream, record):
                points += record_points(stream, record, now)
            new.setdefault(stream, []).append(name)
        if points:
            self.log_points(points)
        changed = bool(new)
        for stream, names in new.items():
            cursor["streams"][stream] = sorted(done.get(stream, set()) | set(names))
        version = _latest_version(self.run)
        if version is not None and version != cursor.get(WEIGHT_TAG):
            self.set_weight_version(version)
            cursor[WEIGHT_TAG], changed = version, True
        changed |= self._sync_report(cursor)
        if changed:
            self._write_cursor(cursor, generation)
        if trainer_done:  # read before the listing: every trainer record was in it
            self.finish()
        return sum(len(v) for v in new.values())

    def _sync_report(self, cursor: dict[str, Any]) -> bool:
        """Upload the report's files whose content changed since the last upload."""
        store = self.run.store
        info = {o.key: o for o in store.list_info(f"{REPORT_PREFIX}/")}
        stamps = {k: str(o.generation) for k, o in info.items()}
        if not stamps or stamps == cursor.get("report"):
            return False
        with tempfile.TemporaryDirectory(prefix="rlax-report-") as tmp:
            files = {}
            for key in sorted(info):
                name = key.split("/", 1)[1]
                files[name] = Path(tmp) / name
                files[name].write_bytes(store.read(key))
            self.log_report(files)
        cursor["report"] = stamps
        return True


def _latest_version(run: TrackedSource) -> int | None:
    from pipeline.paramserver import ParamServer  # only its LATEST pointer is read

    return ParamServer(run.store).latest_version()


class MlflowSink(TrackerSink):
    """MLflow (`tracking.mlflow_uri`: an MLflow server, http(s)://..., or a local store).
    One experiment per `tracking.experiment`; the run is named after the run's directory
    and tagged with its URL. Metric timestamps are the records' own, so a point sent twice
    is one point on the server."""

    name = "mlflow"

    def __init__(self, run: TrackedSource, cfg: TrackingConfig, log: Log) -> None:
        super().__init__(run, cfg, log)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=cfg.mlflow_uri)

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(self.cfg.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(self.cfg.experiment)
        except MlflowException:  # created meanwhile by another exporter
            return self.client.get_experiment_by_name(self.cfg.experiment).experiment_id

    def create(self, params: dict[str, str]) -> TrackedRun:
        from mlflow.entities import Param

        exp = self._experiment_id()
        name = self.run.url.rstrip("/").rsplit("/", 1)[-1]
        created = self.client.create_run(exp, run_name=name, tags={"rlax.run": self.run.url})
        run_id = created.info.run_id
        items = [Param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(items), MLFLOW_PARAMS_BATCH):
            self.client.log_batch(run_id, params=items[i : i + MLFLOW_PARAMS_BATCH])
        url = ""
        if self.cfg.mlflow_uri.startswith(("http://", "https://")):
            url = f"{self.cfg.mlflow_uri.rstrip('/')}/#/experiments/{exp}/runs/{run_id}"
        return TrackedRun(self.name, run_id, url)

    def attach(self, tracked: TrackedRun, params: dict[str, str] | None) -> None:
        self.client.get_run(tracked.run_id)  # fail here, clearly, if it was deleted

    def discard(self, tracked: TrackedRun) -> None:
        self.client.delete_run(tracked.run_id)

    def log_points(self, points: list[Point]) -> None:
        from mlflow.entities import Metric

        assert self.tracked is not None
        metrics = [Metric(p.tag, p.value, int(p.time * 1000), p.step) for p in points]
        for i in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.tracked.run_id, metrics=metrics[i : i + MLFLOW_BATCH])

    def set_weight_version(self, version: int) -> None:
        assert self.tracked is not None
        self.client.set_tag(self.tracked.run_id, WEIGHT_TAG, str(version))

    def log_report(self, files: dict[str, Path]) -> None:
        assert self.tracked is not None
        for path in files.values():
            self.client.log_artifact(self.tracked.run_id, str(path), artifact_path=REPORT_PREFIX)

    def finish(self) -> None:
        assert self.tracked is not None
        if self.client.get_run(self.tracked.run_id).info.status != "FINISHED":
            self.client.set_terminated(self.tracked.run_id, status="FINISHED")


class WandbSink(TrackerSink):
    """Weights & Biases, online (`WANDB_API_KEY` in the exporter's environment) or offline
    (`tracking.wandb_mode: offline`: run files under `tracking.wandb_dir`, by default
    `{run}/wandb` of a local run; upload them later with `wandb sync --append`). The run
    id is chosen here, so the create-only record comes before the tracker's run. Each
    stream has its own x axis (`{stream}/{step|batch_index|version}`, `define_metric`)."""

    name = "wandb"

    def __init__(self, run: TrackedSource, cfg: TrackingConfig, log: Log) -> None:
        super().__init__(run, cfg, log)
        self._wb = None
        self._axes: set[str] = set()

    def _dir(self) -> str | None:
        from pipeline.storage import local_path

        if self.cfg.wandb_dir:
            return self.cfg.wandb_dir
        path = local_path(self.run.store.url)
        return None if path is None else str(path)  # wandb adds its own "wandb/"

    def create(self, params: dict[str, str]) -> TrackedRun:
        run_id = uuid.uuid4().hex[:12]
        url = ""
        if self.cfg.wandb_mode == "online" and self.cfg.wandb_entity:
            url = f"https://wandb.ai/{self.cfg.wandb_entity}/{self.cfg.experiment}/runs/{run_id}"
        return TrackedRun(self.name, run_id, url)

    def attach(self, tracked: TrackedRun, params: dict[str, str] | None) -> None:
        import wandb

        directory = self._dir()
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self._wb = wandb.init(
            project=self.cfg.experiment,
            entity=self.cfg.wandb_entity or None,
            id=tracked.run_id,
            name=self.run.url.rstrip("/").rsplit("/", 1)[-1],
            resume="allow",
            mode=self.cfg.wandb_mode,
            dir=directory,
            config=params,  # None when resuming: the config is there already
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )

    def log_points(self, points: list[Point]) -> None:
        from pipeline.tb_export import x_key

        by_x: dict[tuple[str, int], dict[str, float]] = {}
        for p in points:
            axis = f"{p.stream}/{x_key(p.stream)}"
            if axis not in self._axes:
                self._wb.define_metric(axis)
                self._wb.define_metric(f"{p.stream}/*", step_metric=axis)
                self._axes.add(axis)
            row = by_x.setdefault((p.stream, p.step), {axis: p.step})
            row[p.tag] = p.value
        for row in by_x.values():
            self._wb.log(row)

    def set_weight_version(self, version: int) -> None:
        others = tuple(t for t in (self._wb.tags or ()) if not t.startswith(WEIGHT_TAG))
        self._wb.tags = (*others, f"{WEIGHT_TAG}={version}")
        self._wb.summary[WEIGHT_TAG] = version

    def log_report(self, files: dict[str, Path]) -> None:
        import wandb

        artifact = wandb.Artifact("report", type="report")
        for name, path in files.items():
            artifact.add_file(str(path), name=f"{REPORT_PREFIX}/{name}")
        self._wb.log_artifact(artifact)

    def close(self) -> None:
        if self._wb is not None:
            self._wb.finish()
            self._wb = None


SINKS: dict[str, type[Sink]] = {
    "tensorboard": TensorBoardSink,
    "mlflow": MlflowSink,
    "wandb": WandbSink,
}
WANDB_MODES = ("online", "offline")


MLFLOW_URI_ALLOWED = (
    "an MLflow tracking URI: http(s)://host:port of an MLflow server, sqlite:///path.db, "
    "file:///dir or databricks"
)


@dataclasses.dataclass(frozen=True)
class TrackingConfig:
    """Where the run's metrics are also shown (`pipeline.tracking`; README, Tracking).

    backends: the sinks fed from the run's metrics records (`pipeline.SINKS`):
        "tensorboard" (event files in `{run}/tensorboard/` of a local run), "mlflow",
        "wandb"; empty: none.
    mlflow_uri: the MLflow tracking URI (needed with "mlflow"); credentials stay in the
        exporter's environment (MLFLOW_TRACKING_TOKEN, ...), never in the config.
    experiment: the MLflow experiment, and the W&B project, that the run goes to.
    wandb_mode: "online" (WANDB_API_KEY in the exporter's environment) or "offline" (run
        files only, for machines without egress: `wandb sync --append` them later).
    wandb_entity: the W&B team or user ("" = the API key's default entity).
    wandb_dir: where W&B writes its run files ("" = the run's directory for a local run,
        else WANDB_DIR or the working directory).
    """

    backends: tuple[str, ...] = ("tensorboard",)
    mlflow_uri: str = ""
    experiment: str = "rlax"
    wandb_mode: str = "online"
    wandb_entity: str = ""
    wandb_dir: str = ""

    def __post_init__(self) -> None:
        for name in self.backends:
            _one_of("tracking.backends", name, SINKS)
        _check(
            len(set(self.backends)) == len(self.backends),
            "tracking.backends",
            list(self.backends),
            "each backend at most once",
        )
        if "mlflow" in self.backends or self.mlflow_uri:
            uri = self.mlflow_uri
            _check(
                "://" in uri or uri.startswith("databricks"),
                "tracking.mlflow_uri",
                uri,
                MLFLOW_URI_ALLOWED,
            )
        _check(bool(self.experiment.strip()), "tracking.experiment", self.experiment, "a name")
        _one_of("tracking.wandb_mode", self.wandb_mode, WANDB_MODES)


class Exporter:
    """Every sink of `cfg.backends`; `sync()` runs each, and a failure of one is logged
    (once until it recovers) and retried on the next `sync()`, never raised."""

    def __init__(self, run: TrackedSource, cfg: TrackingConfig, *, log: Log = print) -> None:
        self.run, self.cfg, self.log = run, cfg, log
        self.sinks: dict[str, Sink | None] = dict.fromkeys(cfg.backends)
        self.failing: set[str] = set()

    def sync(self) -> dict[str, int]:
        """Run every sink once; returns {sink: records it logged} (0 for a failing one)."""
        logged = dict.fromkeys(self.sinks, 0)
        for name in self.sinks:
            try:
                sink = self.sinks[name]
                if sink is None:
                    sink = self.sinks[name] = SINKS[name](self.run, self.cfg, self.log)
                logged[name] = sink.sync()
            except Exception as err:  # a tracker's failure must never fail the run
                if name not in self.failing:
                    self.log(f"[tracking] {name} failed: {_first_line(err)}; retried later")
                    self.failing.add(name)
                self._drop(name)  # reconnect from scratch next time
            else:
                if name in self.failing:
                    self.log(f"[tracking] {name} recovered")
                    self.failing.discard(name)
        return logged

    def _drop(self, name: str) -> None:
        sink, self.sinks[name] = self.sinks[name], None
        if sink is None:
            return
        try:
            sink.close()
        except Exception as err:  # never fails the caller; reported unless already failing
            if name not in self.failing:
                self.log(f"[tracking] {name} failed to close: {_first_line(err)}")

    def close(self) -> None:
        for name in self.sinks:
            self._drop(name)


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def export(
    run: TrackedSource,
    cfg: TrackingConfig | None = None,
    *,
    follow: bool = False,
    poll_s: float = 5.0,
    log: Log = print,
) -> dict[str, int]:
    """Feed the run's records to the backends of `cfg` (default: the run's own `tracking`
    section); with `follow`, keep going until the trainer is done and a pass finds nothing
    new. Returns {backend: records it logged} (TensorBoard rewrites all of them)."""
    ex = Exporter(run, cfg or run.config.tracking, log=log)
    total = dict.fromkeys(ex.sinks, 0)
    try:
        while True:
            done = run.store.exists(DONE_KEY)
            logged = ex.sync()
            for name, n in logged.items():
                total[name] += n
            if not follow or (done and not any(logged.values())):
                break
            time.sleep(poll_s)
    finally:
        ex.close()
    return total
