"""The retry policy and the retry layer for any store.

``call_with_retry`` retries transient failures (``TransientStorageError``, or whatever the
caller's ``is_transient`` says) with bounded exponential backoff and jitter; ``GCSStore``
uses it directly, ``RetryingStore`` wraps any other store with it.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.storage.base import (
    _COPY_CHUNK,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    T,
    TransientStorageError,
    _Counter,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter.

    The n-th retry sleeps uniform(cap/2, cap) with cap = min(max_backoff_s,
    initial_backoff_s * multiplier**(n-1)); half-jitter keeps a floor so retries never spin.
    """

    max_attempts: int = 8
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 16.0
    multiplier: float = 2.0
    deadline_s: float | None = 300.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                "backoff must satisfy 0 <= initial_backoff_s <= max_backoff_s, got "
                f"{self.initial_backoff_s} and {self.max_backoff_s}"
            )
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")

    def backoff(self, retry_number: int, rng: random.Random) -> float:
        cap = min(
            self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry_number - 1)
        )
        return rng.uniform(cap / 2, cap)


def call_with_retry(
    fn: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Run ``fn``; retry transient failures per ``policy``; wrap the rest in ``StorageError``.

    ``what`` names the operation and object ("read gs://b/run/weights/LATEST") in every error.
    """
    rng = rng or random.Random()
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except StorageError as exc:
            if not isinstance(exc, TransientStorageError):
                raise
            err: BaseException = exc
        except Exception as exc:
            if not is_transient(exc):
                raise StorageError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
            err = exc
        elapsed = time.monotonic() - start
        delay = policy.backoff(attempt, rng)
        out_of_time = policy.deadline_s is not None and elapsed + delay > policy.deadline_s
        if attempt >= policy.max_attempts or out_of_time:
            raise StorageError(
                f"{what} failed after {attempt} attempts over {elapsed:.1f}s; "
                f"last error: {type(err).__name__}: {err}"
            ) from err
        log.debug("retrying %s after %s (attempt %d, sleeping %.3fs)", what, err, attempt, delay)
        if on_retry is not None:
            on_retry(err)
        sleep(delay)


class RetryingStore(ObjectStore):
    """The retry layer for any store: retries ``TransientStorageError`` per ``policy``.

    After an ambiguous failure, a create-only write or CAS that then reports False is resolved
    by comparing the stored bytes with ours, so identical bytes count as our own write.
    Callers that need exclusivity put a unique nonce in the content (ParamServer's EPOCH and
    BatchLeases' lease objects do). ``GCSStore`` does not need this wrapper: it has its own
    retries with exact, token-based resolution.
    """

    def __init__(
        self,
        inner: ObjectStore,
        policy: RetryPolicy | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        is_transient: Callable[[BaseException], bool] | None = None,
        _retries: _Counter | None = None,
    ) -> None:
        self.inner = inner
        self._policy = policy or RetryPolicy()
        self._sleep = sleep
        self._is_transient = is_transient or (lambda e: isinstance(e, TransientStorageError))
        self._retries = _retries or _Counter()
        self._rng = random.Random()

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def retries(self) -> int:
        return self._retries.value

    def child(self, prefix: str) -> RetryingStore:
        return RetryingStore(
            self.inner.child(prefix),
            self._policy,
            sleep=self._sleep,
            is_transient=self._is_transient,
            _retries=self._retries,
        )

    def _retry(self, op: str, key: str, fn: Callable[[], T]) -> T:
        return call_with_retry(
            fn,
            what=f"{op} {self.url_of(key)}",
            policy=self._policy,
            is_transient=self._is_transient,
            sleep=self._sleep,
            rng=self._rng,
            on_retry=lambda _exc: self._retries.add(),
        )

    def _resolving(
        self, op: str, key: str, write: Callable[[], bool], ours: Callable[[], bool]
    ) -> bool:
        failed_before = False

        def attempt() -> bool:
            nonlocal failed_before
            try:
                if write():
                    return True
            except Exception as exc:
                failed_before = failed_before or self._is_transient(exc)
                raise
            return failed_before and ours()

        return self._retry(op, key, attempt)

    def write_new(self, key: str, data: bytes) -> bool:
        def ours() -> bool:
            try:
                return self.inner.read(key) == data
            except ObjectNotFound:
                return False

        return self._resolving("write_new", key, lambda: self.inner.write_new(key, data), ours)

    def write_new_file(self, key: str, local_path: str | os.PathLike[str]) -> bool:
        def ours() -> bool:
            try:
                stored = self.inner.read(key)
            except ObjectNotFound:
                return False
            return _file_equals(local_path, stored)

        return self._resolving(
            "write_new_file", key, lambda: self.inner.write_new_file(key, local_path), ours
        )

    def compare_and_swap(self, key: str, data: bytes, expected_generation: int | None) -> bool:
        def ours() -> bool:
            current = self.inner.read_versioned(key)
            return current is not None and current[0] == data

        return self._resolving(
            "compare_and_swap",
            key,
            lambda: self.inner.compare_and_swap(key, data, expected_generation),
            ours,
        )

    def read(self, key: str) -> bytes:
        return self._retry("read", key, lambda: self.inner.read(key))

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self._retry("read_range", key, lambda: self.inner.read_range(key, start, length))

    def read_to_file(self, key: str, local_path: str | os.PathLike[str]) -> None:
        self._retry("read_to_file", key, lambda: self.inner.read_to_file(key, local_path))

    def exists(self, key: str) -> bool:
        return self._retry("exists", key, lambda: self.inner.exists(key))

    def list(self, prefix: str = "") -> list[str]:
        return self._retry("list", prefix, lambda: self.inner.list(prefix))

    def delete(self, key: str) -> None:
        self._retry("delete", key, lambda: self.inner.delete(key))

    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        return self._retry("read_versioned", key, lambda: self.inner.read_versioned(key))


def _file_equals(local_path: str | os.PathLike[str], data: bytes) -> bool:
    if os.path.getsize(local_path) != len(data):
        return False
    view = memoryview(data)
    offset = 0
    with open(local_path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            if view[offset : offset + len(chunk)] != chunk:
                return False
            offset += len(chunk)
    return True
