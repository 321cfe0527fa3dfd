"""``MemoryStore``: ``memory://name/prefix``, an object store held in this process's memory.

Stores opened with the same name share one bucket (as two ``gs://`` stores on one bucket
do), so ``open_store("memory://b/run")`` and ``open_store("memory://b").child("run")`` see
the same objects; another process sees an empty bucket of that name. It keeps the contract
of the other backends: create-only writes, generations that change on every write and are
never reused, and compare-and-swap on them. For tests and for trying things in one process.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

from pipeline.storage.base import (
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    _join,
    _validate_prefix,
    _write_replacing,
    validate_key,
)
from pipeline.storage.urls import StorageUrl


class _Bucket:
    """Objects by full name -> (data, generation); one lock makes every operation atomic."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.generations = itertools.count(1)  # shared by all objects: never reused


_BUCKETS: dict[str, _Bucket] = {}
_BUCKETS_LOCK = threading.Lock()


def _bucket(name: str) -> _Bucket:
    with _BUCKETS_LOCK:
        return _BUCKETS.setdefault(name, _Bucket())


class MemoryStore(ObjectStore):
    """The bucket ``name`` (created on first use) under ``prefix``."""

    URL_FORMS = "memory://name/prefix (this process only)"

    @classmethod
    def from_url(cls, url: StorageUrl, **options: Any) -> MemoryStore:
        return cls(url.bucket, url.key, **options)

    def __init__(self, name: str, prefix: str = "") -> None:
        if not name or "/" in name:
            raise ValueError(f"memory store name must be non-empty without '/', got {name!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        self._name = name
        self._prefix = prefix
        self._bucket = _bucket(name)

    @property
    def url(self) -> str:
        return f"memory://{self._name}/{self._prefix}" if self._prefix else f"memory://{self._name}"

    def child(self, prefix: str) -> MemoryStore:
        return MemoryStore(self._name, _join(self._prefix, validate_key(prefix.strip("/"))))

    def _name_of(self, key: str) -> str:
        return _join(self._prefix, validate_key(key))

    def _put(self, key: str, data: bytes, expected_generation: int | None) -> bool:
        """Store ``data`` iff the object's generation is ``expected_generation`` (None: absent)."""
        name = self._name_of(key)
        with self._bucket.lock:
            current = self._bucket.objects.get(name)
            if (None if current is None else current[1]) != expected_generation:
                return False
            self._bucket.objects[name] = (bytes(data), next(self._bucket.generations))
            return True

    def _get(self, key: str) -> tuple[bytes, int] | None:
        name = self._name_of(key)
        with self._bucket.lock:
            return self._bucket.objects.get(name)

    def write_new(self, key: str, data: bytes) -> bool:
        return self._put(key, data, None)

    def write_new_file(self, key: str, local_path: str | os.PathLike[str]) -> bool:
        with open(local_path, "rb") as f:
            return self._put(key, f.read(), None)

    def compare_and_swap(self, key: str, data: bytes, expected_generation: int | None) -> bool:
        return self._put(key, data, expected_generation)

    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        return self._get(key)

    def read(self, key: str) -> bytes:
        found = self._get(key)
        if found is None:
            raise ObjectNotFound(self.url_of(key))
        return found[0]

    def read_to_file(self, key: str, local_path: str | os.PathLike[str]) -> None:
        data = self.read(key)
        _write_replacing(local_path, lambda out: out.write(data))

    def exists(self, key: str) -> bool:
        return self._get(key) is not None

    def list(self, prefix: str = "") -> list[str]:
        return [info.key for info in self.list_info(prefix)]

    def list_info(self, prefix: str = "") -> list[ObjectInfo]:
        prefix = _validate_prefix(prefix)
        # Like GCS: a plain string prefix on full names, the store's own prefix cut off.
        full = _join(self._prefix, prefix) if prefix else _join(self._prefix, "")
        strip = len(self._prefix) + 1 if self._prefix else 0
        with self._bucket.lock:
            found = [
                ObjectInfo(name[strip:], len(data), generation)
                for name, (data, generation) in self._bucket.objects.items()
                if name.startswith(full)
            ]
        return sorted(found, key=lambda info: info.key)

    def delete(self, key: str) -> None:
        name = self._name_of(key)
        with self._bucket.lock:
            self._bucket.objects.pop(name, None)

    def __getstate__(self) -> dict[str, str]:
        # The bucket is this process's; a copy in another process opens its own by name.
        return {"name": self._name, "prefix": self._prefix}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["name"], state["prefix"])
