"""The run's `storage` section: where runs live."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import check as _check


@dataclass(frozen=True)
class StorageConfig:
    """Where runs live: a local directory or gs://bucket/prefix."""

    root: str = "runs"

    def __post_init__(self) -> None:
        _check(bool(self.root), "storage.root", self.root, "a local path or gs://bucket/prefix")
