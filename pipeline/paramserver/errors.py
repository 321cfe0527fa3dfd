"""The parameter server's errors."""

from __future__ import annotations

__all__ = [
    "CorruptSnapshotError",
    "ParamServerError",
    "SnapshotNotFoundError",
    "StaleEpochError",
]


class ParamServerError(Exception):
    """Base class of parameter-server errors."""


class StaleEpochError(ParamServerError):
    """A newer trainer epoch exists; this trainer must stop publishing."""


class CorruptSnapshotError(ParamServerError):
    """A committed snapshot failed verification (missing shard, wrong size or crc32c)."""


class SnapshotNotFoundError(ParamServerError, LookupError):
    """No committed snapshot for the requested version (or no LATEST yet)."""
