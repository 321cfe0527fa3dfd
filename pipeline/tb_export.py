r"""TensorBoard export of a run's metrics records.

    rlax tensorboard --run RUN [--logdir DIR] [--follow]
    tensorboard --logdir DIR

Reads only the run's immutable metrics records (`Run.read_metrics`, `metrics/{stream}/`)
and writes TensorBoard event files (tensorboardX) to a local directory, one
subdirectory per stream: `train/` (reward, loss, kl, clip fraction, staleness, timings
... per trainer step), `sft/` (loss per SFT step), `eval/` (every evaluation metric per
weight version, `tag/lo` and `tag/hi` its 95% interval, per task and judge statistics),
`eval-n{n}-k{...}/` (evaluations with other k, same tags), `orm/` and `orm_train/` (the
ORM baseline), `dropped/`. Every numeric leaf of a record becomes a scalar tagged
`{stream}/{path}`; the x axis is the record's `step` (train) or `version` (eval), else
its index. TensorBoard tags allow only `[-/\w.]`, so "@" is written "_at_" (`pass@8` is
`eval/pass_at_8`) and any other character "_" (`tb_tag`).

The exporter owns the logdir: it deletes the event files under it and rewrites them
from the records on every start (so a restart never duplicates points), and again if a
record appears out of order (an evaluation of an older version, say). `--follow` keeps
exporting new records as they appear until the trainer is done (`trainer/DONE.json`)
and a pass finds nothing new. `rlax report` refreshes `{run}/tensorboard/` for a local
run (the `tensorboard` backend of `pipeline/tracking.py`, the default). tensorboardX is
imported only when exporting, so `pipeline` stays light.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from pipeline.layout import DONE_KEY
from pipeline.storage import ObjectStore, local_path


class RunRecords(Protocol):
    """What the exporters read of a run: its store (`pipeline.run.Run` is one). Named here
    rather than imported: pipeline.run imports the config, which composes the tracking
    section defined beside these exporters, so importing Run would close an import loop."""

    store: ObjectStore


EVENT_PREFIX = "events.out.tfevents."
SKIP_KEYS = {"index", "time", "step", "version"}  # bookkeeping, or the x axis itself
X_KEYS = {"rollout": "batch_index"}  # streams whose x axis is not the trainer step
CI_KEYS = {"mean", "lo", "hi"}


def local_logdir(run: RunRecords) -> Path | None:
    """`{run}/tensorboard` for a run in a local directory; None for a gs:// run."""
    path = local_path(run.store.url)
    return None if path is None else path / "tensorboard"


def tb_tag(path: str) -> str:
    r"""A TensorBoard-safe tag: "@" -> "_at_", other characters outside [-/\w.] -> "_"."""
    return re.sub(r"[^-/\w.]", "_", path.replace("@", "_at_"))


def x_key(stream: str) -> str:
    """The field of a stream's records that is its x axis: weight version for evaluations,
    batch index for rollout attempts (their tool use and generation / tool time), else the
    trainer step."""
    return "version" if stream.startswith("eval") else X_KEYS.get(stream, "step")


def x_value(stream: str, record: dict[str, Any]) -> int:
    """The record's position on the x axis (`x_key`), else its index."""
    value = record.get(x_key(stream), record.get("index", 0))
    return int(value)


def scalars(stream: str, record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """(tag, value) of every numeric leaf of a record. An evaluation's `metrics` are at the
    stream's top level; a {mean, lo, hi} leaf gives `tag`, `tag/lo` and `tag/hi`."""

    def walk(prefix: str, node: Any) -> Iterator[tuple[str, float]]:
        if isinstance(node, dict):
            if set(node) >= CI_KEYS and all(_number(node[k]) for k in CI_KEYS):
                yield prefix, float(node["mean"])
                yield f"{prefix}/lo", float(node["lo"])
                yield f"{prefix}/hi", float(node["hi"])
                rest = {k: v for k, v in node.items() if k not in CI_KEYS}
            else:
                rest = node
            for key, value in rest.items():
                yield from walk(f"{prefix}/{key}", value)
        elif _number(node):
            yield prefix, float(node)

    for key, value in record.items():
        if key in SKIP_KEYS:
            continue
        if stream.startswith("eval") and key == "metrics":
            yield from walk(stream, value)
        else:
            yield from walk(f"{stream}/{key}", value)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def clear_logdir(logdir: Path) -> None:
    """Delete the event files under `logdir` (only those: the rest is left alone)."""
    if not logdir.is_dir():
        return
    for dirpath, _dirs, files in os.walk(logdir):
        for name in files:
            if name.startswith(EVENT_PREFIX):
                os.unlink(os.path.join(dirpath, name))


class Exporter:
    """Incremental export: `sync()` writes the records not written yet; a record that
    would go before one already written (per stream) restarts the export from scratch."""

    def __init__(self, run: RunRecords, logdir: str | os.PathLike[str], *, log=print) -> None:
        self.run = run
        self.logdir = Path(logdir)
        self.log = log
        self._writers: dict[str, Any] = {}
        self._seen: set[str] = set()
        self._last: dict[str, str] = {}  # stream -> last key written

    def reset(self) -> None:
        self.close()
        clear_logdir(self.logdir)
        self._seen.clear()
        self._last.clear()

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()

    def _writer(self, stream: str):
        if stream not in self._writers:
            from tensorboardX import SummaryWriter

            self._writers[stream] = SummaryWriter(logdir=str(self.logdir / stream), flush_secs=5)
        return self._writers[stream]

    def _pending(self) -> list[str]:
        keys = [
            k for k in self.run.store.list("metrics/") if k.endswith(".json") and k.count("/") == 2
        ]
        return [k for k in keys if k not in self._seen]

    def sync(self) -> int:
        """Write every record not written yet; returns how many were written."""
        new = self._pending()
        if any(k < self._last.get(k.split("/")[1], "") for k in new):
            self.log("[tensorboard] a record arrived out of order; rewriting from scratch")
            self.reset()
            new = self._pending()
        for key in new:
            stream = key.split("/")[1]
            record = json.loads(self.run.store.read(key))
            w = self._writer(stream)
            step, wall = x_value(stream, record), float(record.get("time", time.time()))
            for tag, value in scalars(stream, record):
                w.add_scalar(tb_tag(tag), value, global_step=step, walltime=wall)
            self._seen.add(key)
            self._last[stream] = max(self._last.get(stream, ""), key)
        for w in self._writers.values():
            w.flush()
        return len(new)


def export(
    run: RunRecords,
    logdir: str | os.PathLike[str],
    *,
    follow: bool = False,
    poll_s: float = 2.0,
    log: Callable[[str], None] = print,
) -> int:
    """Rewrite `logdir` from the run's metrics records; with `follow`, keep adding new
    records until the trainer is done and a pass finds nothing new. Returns the number of
    records written."""
    ex = Exporter(run, logdir, log=log)
    ex.reset()
    total = 0
    try:
        while True:
            done = run.store.exists(DONE_KEY)
            n = ex.sync()
            total += n
            if not follow or (done and n == 0):
                break
            time.sleep(poll_s)
    finally:
        ex.close()
    log(f"[tensorboard] {total} records -> {logdir}  (tensorboard --logdir {logdir})")
    return total
