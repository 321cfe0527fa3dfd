"""The parameter server's errors."""

from __future__ import annotations

__all__ = [
    "CorruptSnapshotError",
    "ParamServerError",
    "SnapshotNotFoundError",
    "StaleEpochError",
    "UnrecoverableVersionError",
]


class ParamServerError(Exception):
    """Base class of parameter-server errors."""


class StaleEpochError(ParamServerError):
    """A newer trainer epoch exists; this trainer must stop publishing."""


class CorruptSnapshotError(ParamServerError):
    """A committed snapshot failed verification (missing shard, wrong size or crc32c)."""


class SnapshotNotFoundError(ParamServerError, LookupError):
    """No committed snapshot for the requested version (or no LATEST yet)."""


class UnrecoverableVersionError(ParamServerError):
    """A version the run still needs is damaged and no exact copy of it is left (neither
    the trainer's parameters, an intact chain in the store nor a checkpoint)."""
