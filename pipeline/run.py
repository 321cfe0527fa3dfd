"""A run: its config, data, weights, rollouts and metrics under one store prefix.

Every role (SFT, trainer, rollout worker, evaluator) opens the run by URL only; the
config frozen in `config.json` at creation is what they all obey.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipeline.config import RunConfig, config_from_json, legacy_digest
from pipeline.layout import (  # noqa: F401 - the layout, re-exported
    ABORT_KEY,
    BASE_PREFIX,
    CHECKPOINT_MANIFESTS,
    CHECKPOINTS_PREFIX,
    CONFIG_KEY,
    CURATED_PREFIX,
    DATA_PREFIX,
    DONE_KEY,
    HF_PREFIX,
    LINEAGE_KEY,
    METRICS_PREFIX,
    ORM_PREFIX,
    PASS_RATES_PREFIX,
    REPORT_PREFIX,
    ROLLOUTS_PREFIX,
    SPLITS,
    START_ADAPTER_PREFIX,
)
from pipeline.parquet_bytes import table_from_bytes, table_to_bytes
from pipeline.storage import ObjectNotFound, ObjectStore, local_path, open_store
from pipeline.tasks.base import Problem

if TYPE_CHECKING:
    from pipeline.paramserver import ParamServer
    from pipeline.paramserver.adapters import PolicyReader


def base_server(run: Run) -> ParamServer:
    """The run's base model: its own parameter server under `base/` (SFT or an HF import
    publishes version 0; the trainer starts from it)."""
    from pipeline.paramserver import ParamServer

    return ParamServer(run.store.child(BASE_PREFIX))


def start_adapter_server(run: Run) -> ParamServer:
    """A LoRA run's starting adapters when they were imported (a PEFT adapter, `tpu_jobs.hf
    import --adapter`): version 0 of a parameter server under `base/`, flat adapter tensors
    (`pipeline.lora`). No version 0 there: the adapters start at the usual init (B = 0)."""
    from pipeline.paramserver import ParamServer

    return ParamServer(run.store.child(BASE_PREFIX).child(START_ADAPTER_PREFIX))


def weights_server(run: Run) -> ParamServer:
    """The run's policy versions (trainer publishes, workers and evaluators pull), with the
    run's `paramserver` settings for shards, ranged reads and their concurrency."""
    from pipeline.paramserver import ParamServer

    ps = run.config.paramserver
    return ParamServer(
        run.store,
        shard_bytes=ps.shard_mib << 20,
        max_workers=ps.pull_concurrency,
        range_bytes=ps.range_mib << 20,
    )


def policy_reader(run: Run) -> PolicyReader:
    """The run's policy as it samples, version by version: its weights, a LoRA run's
    adapters merged into its base (`pipeline.paramserver.adapters.PolicyReader`)."""
    from pipeline.paramserver.adapters import PolicyReader

    return PolicyReader(weights_server(run), base_server(run))


def orm_server(run: Run) -> ParamServer:
    """The run's ORM baseline (an external verifier, `tpu_jobs.orm`): version 0 under
    `orm/`, read by the evaluator."""
    from pipeline.paramserver import ParamServer

    return ParamServer(run.store.child(ORM_PREFIX))


class RunError(RuntimeError):
    """The run directory is missing, incomplete or belongs to another config."""


def check_run_url(url: str) -> None:
    """Refuse a local run URL that names no directory of its own ('.', '..', 'runs/..',
    '/'): the run's keys would land among the files of the current or a parent directory.
    (A bucket prefix with '.' or '..' segments is refused by `split_url`.)"""
    path = local_path(url)
    if path is not None and PurePosixPath(os.fspath(path)).name in ("", ".", ".."):
        raise RunError(
            f"--run {url!r} names an existing directory ('.', '..' or '/'), not a run's own; "
            "allowed: a new directory for the run, e.g. runs/my-run"
        )


@dataclass
class Run:
    url: str
    store: ObjectStore
    config: RunConfig

    @classmethod
    def create(cls, url: str, config: RunConfig) -> Run:
        """Create the run, or reopen it if it exists with the same config (a retry)."""
        check_run_url(url)
        store = open_store(url)
        blob = json.dumps(config.to_dict(), indent=2, sort_keys=True).encode()
        if not store.write_new(CONFIG_KEY, blob):
            existing = config_from_json(store.read(CONFIG_KEY).decode())
            if existing.digest() != config.digest():
                raise RunError(
                    f"run {url} already exists with a different config "
                    f"(digest {existing.digest()} != {config.digest()}); "
                    "choose a new --run or repeat the original config"
                )
            config = existing
        return cls(url=url, store=store, config=config)

    @classmethod
    def open(cls, url: str) -> Run:
        store = open_store(url)
        try:
            text = store.read(CONFIG_KEY).decode()
        except ObjectNotFound:
            raise RunError(
                f"no run at {url}: {CONFIG_KEY} not found. Create one with "
                "`rlax demo --run URL` or `rlax init --run URL --config configs/X.yaml`"
            ) from None
        return cls(url=url, store=store, config=config_from_json(text))

    def config_digests(self) -> set[str]:
        """The config digests a checkpoint of this run may carry: `config.digest()`, and
        the digest that versions before it computed from the stored config.json (so a run
        created by one of them still resumes)."""
        digests = {self.config.digest()}
        with contextlib.suppress(ObjectNotFound):  # a Run built in memory: today's only
            digests.add(legacy_digest(json.loads(self.store.read(CONFIG_KEY).decode())))
        return digests

    # ----------------------------------------------------------------- data
    def data_key(self, split: str) -> str:
        if split not in SPLITS:
            raise ValueError(f"split {split!r} unknown; allowed: {', '.join(SPLITS)}")
        return f"{DATA_PREFIX}/{split}.parquet"

    def write_problems(self, split: str, problems: list[Problem]) -> bool:
        rows = [p.to_dict() for p in problems]
        table = pa.Table.from_pylist(
            [{**r, "meta": json.dumps(r["meta"], sort_keys=True)} for r in rows]
        )
        return self.store.write_new(self.data_key(split), table_to_bytes(table))

    def has_problems(self, split: str) -> bool:
        return self.store.exists(self.data_key(split))

    def read_problems(self, split: str) -> list[Problem]:
        try:
            data = self.store.read(self.data_key(split))
        except ObjectNotFound:
            raise RunError(
                f"run {self.url} has no {split} data yet; run `rlax init --run {self.url}`"
            ) from None
        rows = table_from_bytes(data).to_pylist()
        return [Problem.from_dict({**r, "meta": json.loads(r["meta"])}) for r in rows]

    # -------------------------------------------------------------- metrics
    def log_metrics(self, stream: str, index: int, record: dict[str, Any]) -> None:
        """Write one immutable metrics record (create-only: a retry is a no-op)."""
        record = {"index": index, "time": time.time(), **record}
        self.store.write_new(
            f"{METRICS_PREFIX}/{stream}/{index:08d}.json",
            json.dumps(record, sort_keys=True).encode(),
        )

    def read_metrics(self, stream: str) -> list[dict[str, Any]]:
        keys = self.store.list(f"{METRICS_PREFIX}/{stream}/")
        return [json.loads(self.store.read(k)) for k in keys]

    def iter_metric_keys(self, stream: str) -> Iterator[str]:
        yield from self.store.list(f"{METRICS_PREFIX}/{stream}/")
