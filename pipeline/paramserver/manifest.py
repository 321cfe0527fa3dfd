"""The stored layout of weight versions: object keys, the manifest (format 2, and format 1
of earlier runs read as format 2), and the small JSON objects LATEST and EPOCH.

A format-2 manifest holds ``version``, ``epoch``, ``attempt``, ``created``, ``metadata``,
``parts`` (tensor ranks of the sampler's mesh), ``anchor`` (nearest full snapshot at or
below the version), ``base`` (the version a delta is against, or None), ``full_every``,
``tensors`` (name, shape, dtype, split ``axis`` and the crc32c of each reconstructed piece)
and a ``full`` and/or ``delta`` section: ``{"shards": [{key, size, crc32c, part}],
"pieces": [{name, part, shard, offset, nbytes}]}`` (the delta's with its ``codec``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import google_crc32c
import numpy as np

from pipeline.paramserver.errors import (
    CorruptSnapshotError,
    ParamServerError,
    SnapshotNotFoundError,
)
from pipeline.storage import ObjectNotFound, ObjectStore

MANIFEST_FORMAT = 2
LATEST = "LATEST"
EPOCH = "EPOCH"
MANIFEST = "manifest.json"
REFUSED = "refused"  # refused/v{version:08d}-{reader}.json: a reader's damage report
QUARANTINE = "quarantine"  # quarantine/v{version:08d}-{stamp}/...: objects a repair replaced
MANIFEST_RE = re.compile(r"^v(\d{8})/manifest\.json$")
VERSION_DIR_RE = re.compile(r"^v(\d{8})/")
MAX_VERSION = 10**8 - 1  # the layout has 8 digits


def version_dir(version: int) -> str:
    return f"v{version:08d}"


def manifest_key(version: int) -> str:
    return f"{version_dir(version)}/{MANIFEST}"


def shard_key(version: int, kind: str, group: str, index: int, attempt: str) -> str:
    return f"{version_dir(version)}/{kind}-{group}-{index:05d}-{attempt}.bin"


def group_of(part: int | None) -> str:
    """The shard group of a piece: ``all`` (unsplit tensors) or ``r{rank:03d}``."""
    return "all" if part is None else f"r{part:03d}"


def crc32c(data: Any) -> int:
    return int(google_crc32c.value(data))


def bytes_of(payload: Any) -> Any:
    """The bytes of an array (a flat uint8 view; the array is C-contiguous) or of bytes."""
    if isinstance(payload, np.ndarray):
        return payload.reshape(-1).view(np.uint8)
    return payload


def nbytes_of(payload: Any) -> int:
    return payload.nbytes if isinstance(payload, np.ndarray) else len(payload)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def resolve_dtype(name: str) -> np.dtype:
    """dtype from its manifest name; extension types (bfloat16, float8_*) come from ml_dtypes."""
    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        import ml_dtypes
    except ImportError as exc:
        raise TypeError(f"dtype {name!r} needs ml_dtypes, which is not installed") from exc
    try:
        return np.dtype(getattr(ml_dtypes, name))
    except AttributeError:
        raise TypeError(
            f"unknown dtype {name!r}: not a numpy dtype nor an ml_dtypes type"
        ) from None


def normalize(manifest: dict[str, Any]) -> dict[str, Any]:
    """A format-1 manifest (full snapshot, no pieces) in format 2's shape."""
    if manifest.get("format", 1) >= 2:
        return manifest
    shards = [{**s, "part": None} for s in manifest["shards"]]
    return {
        **manifest,
        "parts": 1,
        "anchor": manifest["version"],
        "base": None,
        "tensors": [
            {
                "name": t["name"],
                "shape": t["shape"],
                "dtype": t["dtype"],
                "axis": None,
                "crc32c": None,
            }  # fmt: skip
            for t in manifest["tensors"]
        ],
        "full": {
            "shards": shards,
            "pieces": [
                {
                    "name": t["name"],
                    "part": 0,
                    "shard": t["shard"],
                    "offset": t["offset"],
                    "nbytes": t["nbytes"],
                }  # fmt: skip
                for t in manifest["tensors"]
            ],
        },
    }


def read_manifest(store: ObjectStore, version: int) -> dict[str, Any]:
    """The committed manifest of ``version`` as stored; SnapshotNotFoundError if there is
    none, CorruptSnapshotError if it is not JSON or describes another version."""
    key = manifest_key(version)
    try:
        raw = store.read(key)
    except ObjectNotFound:
        raise SnapshotNotFoundError(
            f"version {version} is not committed: {store.url_of(key)} does not exist"
        ) from None
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise CorruptSnapshotError(f"manifest {store.url_of(key)} is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("version") != version:
        raise CorruptSnapshotError(
            f"manifest {store.url_of(key)} describes version "
            f"{manifest.get('version') if isinstance(manifest, dict) else manifest!r}, "
            f"expected {version}"
        )
    return manifest


def read_normalized(store: ObjectStore, version: int) -> dict[str, Any]:
    """``read_manifest`` in format 2's shape."""
    manifest = read_manifest(store, version)
    try:
        return normalize(manifest)
    except (KeyError, TypeError) as exc:
        raise CorruptSnapshotError(
            f"manifest {store.url_of(manifest_key(version))} lacks {exc}"
        ) from None


def parse_epoch(store: ObjectStore, raw: bytes) -> int:
    """The epoch number held by EPOCH's bytes."""
    try:
        epoch = json.loads(raw)["epoch"]
        if isinstance(epoch, int):
            return epoch
    except (ValueError, KeyError, TypeError):
        pass
    raise ParamServerError(f"{store.url_of(EPOCH)} holds unreadable data {raw[:100]!r}")


def parse_latest(store: ObjectStore, raw: bytes) -> dict[str, Any]:
    """``{"version", "epoch"}`` from LATEST's bytes."""
    try:
        pointer = json.loads(raw)
        version, epoch = pointer["version"], pointer.get("epoch", 0)
        if (version is None or isinstance(version, int)) and isinstance(epoch, int):
            return {"version": version, "epoch": epoch}
    except (ValueError, KeyError, TypeError):
        pass
    raise ParamServerError(f"{store.url_of(LATEST)} holds unreadable data {raw[:100]!r}")
