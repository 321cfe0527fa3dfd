"""Scheduled retraining: one child run per logical date, based on a parent's snapshot.

Layout (RETRAIN_ROOT defaults to `<parent run URL>-retrain`):

    RETRAIN_ROOT/20260105/              the child run of logical date 2026-01-05
        curated/                        the Beam curation of that date's source data
        lineage.json                    the pinned base: {"run", "version", ...} (create-only)
        base/weights/v00000000/         that snapshot, copied: the trainer starts from it
    RETRAIN_ROOT/_lineage/20260105.json written when the child's run is complete:
                                        {"run", "version"} of its final snapshot

The base of date D is the final snapshot of the newest completed child with a date
before D (`chain`), else the parent run's latest published version. It is pinned in
the child's `lineage.json` the first time D runs, so re-running D (or running it after
later dates) reuses the same base; data, weights and metrics are create-only and a
finished trainer is not restarted: re-running a date changes nothing.

Plain functions (no Airflow): the retraining DAG calls them, and they are tested directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.layout import LINEAGE_KEY

LINEAGE_DIR = "_lineage"
PIN_KEY = LINEAGE_KEY


class LineageError(RuntimeError):
    """The parent run is missing or has nothing published to continue from."""


def date_key(ds: str) -> str:
    """`2026-01-05` -> `20260105` (sorts like the dates)."""
    return ds.replace("-", "")


def default_retrain_root(parent_url: str) -> str:
    return parent_url.rstrip("/") + "-retrain"


def child_url(retrain_root: str, ds: str) -> str:
    return f"{retrain_root.rstrip('/')}/{date_key(ds)}"


def render_source(template: str, ds: str) -> str:
    """`data/incoming/{ds}/*.jsonl` -> `data/incoming/2026-01-05/*.jsonl` (also {ds_nodash})."""
    return template.replace("{ds_nodash}", date_key(ds)).replace("{ds}", ds)


def choose_base(parent_url: str, retrain_root: str, ds: str, chain: bool) -> dict[str, Any]:
    """The snapshot date `ds` continues from (see the module doc)."""
    from pipeline.paramserver import ParamServer
    from pipeline.run import Run, RunError
    from pipeline.storage import open_store

    if chain:
        index = open_store(retrain_root).child(LINEAGE_DIR)
        earlier = [k for k in index.list("") if k.endswith(".json") and k[:-5] < date_key(ds)]
        if earlier:
            record = json.loads(index.read(max(earlier)))
            return {"run": record["run"], "version": int(record["version"]), "via": "chain"}
    try:
        parent = Run.open(parent_url)
    except RunError as err:
        raise LineageError(str(err)) from None
    version = ParamServer(parent.store).latest_version()
    if version is None:
        raise LineageError(f"parent run {parent_url} has no published weight version yet")
    return {"run": parent_url, "version": int(version), "via": "parent"}


def child_config(parent_config, retrain_root: str, params: Mapping[str, Any]):
    """The parent's config with the retraining Params applied (steps, workers, overrides)."""
    from pipeline.config import load_config

    extra: dict[str, Any] = {"storage": {"root": retrain_root}}
    if params.get("steps") is not None:
        extra["trainer"] = {"steps": params["steps"]}
    if params.get("workers") is not None:
        extra["workers"] = params["workers"]
    tree = parent_config.to_dict()
    return load_config(None, params.get("overrides") or (), extra=_merge(tree, extra))


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def pin_base(store, choice: Mapping[str, Any], ds: str) -> dict[str, Any]:
    """Pin `choice` as the child's base unless one is pinned already; the pinned one."""
    record = {**choice, "logical_date": ds, "pinned_at": time.time()}
    store.write_new(PIN_KEY, json.dumps(record, sort_keys=True).encode())
    return json.loads(store.read(PIN_KEY))


def seed_base(child, pinned: Mapping[str, Any]) -> bool:
    """Copy the pinned snapshot to the child's base/ as version 0 (once)."""
    from pipeline.run import Run, base_server, policy_reader

    base = base_server(child)
    if 0 in base.versions():
        return False
    # The parent's policy as it samples: a LoRA parent's adapters merged into its base.
    parent = Run.open(pinned["run"])
    snap = policy_reader(parent).pull(int(pinned["version"]))
    return base.publish(
        0,
        dict(snap.tensors),
        epoch=base.acquire_epoch(),
        metadata={"source": "retrain", "run": pinned["run"], "version": int(pinned["version"])},
    )


def prepare_child(
    parent_url: str,
    retrain_root: str,
    ds: str,
    params: Mapping[str, Any],
    *,
    chain: bool = True,
):
    """Create (or reopen) the child run of `ds`: config, data, pinned base. Returns the Run.

    Expects the curated data under the child's `curated/` (the curate task)."""
    from pipeline.run import Run, RunError

    try:
        parent = Run.open(parent_url)
    except RunError as err:
        raise LineageError(str(err)) from None
    url = child_url(retrain_root, ds)
    child = Run.create(url, child_config(parent.config, retrain_root, params))
    if child.store.exists(PIN_KEY):
        pinned = json.loads(child.store.read(PIN_KEY))
    else:
        pinned = pin_base(child.store, choose_base(parent_url, retrain_root, ds, chain), ds)
    from pipeline.problem_sets import write_curated_data

    write_curated_data(child, eval_from=parent.read_problems("eval"))
    seed_base(child, pinned)
    return child


def register(retrain_root: str, ds: str, url: str) -> dict[str, Any]:
    """Record the finished child of `ds` (its final version) for later dates to chain from."""
    from pipeline.paramserver import ParamServer
    from pipeline.run import DONE_KEY, Run
    from pipeline.storage import open_store

    run = Run.open(url)
    done = json.loads(run.store.read(DONE_KEY))
    version = ParamServer(run.store).latest_version()
    record = {"run": url, "version": version, "logical_date": ds, "step": done.get("step")}
    index = open_store(retrain_root).child(LINEAGE_DIR)
    index.write_new(f"{date_key(ds)}.json", json.dumps(record, sort_keys=True).encode())
    return json.loads(index.read(f"{date_key(ds)}.json"))


def eval_set_url(parent_run) -> str:
    """The parent's held-out set as a URL for `--eval-sets` (decontamination)."""
    return parent_run.store.url_of(parent_run.data_key("eval"))


def worker_ids_of(run) -> Sequence[str]:
    from pipeline.layout import worker_ids

    return worker_ids(run.config.workers)
