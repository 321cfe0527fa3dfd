"""Fault injection: ``FlakyStore`` makes a fraction of a store's calls fail transiently."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable

from pipeline.storage.base import ObjectStore, T, TransientStorageError, _Counter


class FlakyStore(ObjectStore):
    """Fault injection: a ``failure_rate`` fraction of calls raise ``TransientStorageError``.

    A ``lost_response_fraction`` of those failures happen *after* the real operation ran (the
    response was lost), the rest before it. ``injected`` counts faults (shared with children).
    """

    def __init__(
        self,
        inner: ObjectStore,
        failure_rate: float,
        *,
        lost_response_fraction: float = 0.5,
        seed: int | None = 0,
        _shared: tuple[random.Random, threading.Lock, _Counter] | None = None,
    ) -> None:
        if not 0.0 <= failure_rate <= 1.0 or not 0.0 <= lost_response_fraction <= 1.0:
            raise ValueError(
                "failure_rate and lost_response_fraction must be in [0, 1], got "
                f"{failure_rate} and {lost_response_fraction}"
            )
        self.inner = inner
        self.failure_rate = failure_rate
        self.lost_response_fraction = lost_response_fraction
        self._shared = _shared or (random.Random(seed), threading.Lock(), _Counter())

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def injected(self) -> int:
        return self._shared[2].value

    def child(self, prefix: str) -> FlakyStore:
        return FlakyStore(
            self.inner.child(prefix),
            self.failure_rate,
            lost_response_fraction=self.lost_response_fraction,
            _shared=self._shared,
        )

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        rng, lock, counter = self._shared
        with lock:
            fail = rng.random() < self.failure_rate
            after = rng.random() < self.lost_response_fraction
        if not fail:
            return fn()
        counter.add()
        if after:
            fn()
            raise TransientStorageError(f"injected fault: response to {op} {self.url_of(key)} lost")
        raise TransientStorageError(f"injected fault: {op} {self.url_of(key)} failed (503)")

    def write_new(self, key: str, data: bytes) -> bool:
        return self._call("write_new", key, lambda: self.inner.write_new(key, data))

    def write_new_file(self, key: str, local_path: str | os.PathLike[str]) -> bool:
        return self._call("write_new_file", key, lambda: self.inner.write_new_file(key, local_path))

    def read(self, key: str) -> bytes:
        return self._call("read", key, lambda: self.inner.read(key))

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self._call("read_range", key, lambda: self.inner.read_range(key, start, length))

    def read_to_file(self, key: str, local_path: str | os.PathLike[str]) -> None:
        self._call("read_to_file", key, lambda: self.inner.read_to_file(key, local_path))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def list(self, prefix: str = "") -> list[str]:
        return self._call("list", prefix, lambda: self.inner.list(prefix))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner.delete(key))

    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        return self._call("read_versioned", key, lambda: self.inner.read_versioned(key))

    def compare_and_swap(self, key: str, data: bytes, expected_generation: int | None) -> bool:
        return self._call(
            "compare_and_swap",
            key,
            lambda: self.inner.compare_and_swap(key, data, expected_generation),
        )
