"""``GCSStore``: a GCS bucket/prefix as an object store.

Create-only and CAS use ``ifGenerationMatch``. The client library's own retries are switched
off; ``call_with_retry`` retries transient failures (429, 408, 5xx, connection resets,
timeouts) with bounded exponential backoff and jitter. A conditional write whose response was
lost is resolved on retry with a per-call token stored in the object's metadata, so a retry
never reports our own write as lost and never claims a write by someone else.

``google.cloud.storage`` is imported lazily (on first use of a client): importing this module
stays cheap.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from pipeline.storage.base import (
    _TMP_PREFIX,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    T,
    TransientStorageError,
    _Counter,
    _join,
    _unlink_quiet,
    _validate_prefix,
    validate_key,
)
from pipeline.storage.retry import RetryPolicy, call_with_retry
from pipeline.storage.urls import StorageUrl

# Custom-metadata key holding the per-call token of a conditional GCS write.
WRITE_TOKEN_KEY = "rlax-write-token"


_RETRYABLE_HTTP = frozenset({408, 429, 500, 502, 503, 504})


def _gcs_is_transient(exc: BaseException) -> bool:
    """429/408/5xx, dropped or reset connections, timeouts, and download checksum mismatches."""
    if isinstance(exc, TransientStorageError | ConnectionError | TimeoutError):
        return True
    code = getattr(exc, "code", None)
    if isinstance(code, int) and code in _RETRYABLE_HTTP:
        return True
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int) and status in _RETRYABLE_HTTP:
        return True
    try:
        from google.cloud.storage.exceptions import DataCorruption
        from google.cloud.storage.retry import _should_retry
    except ImportError:  # pragma: no cover - only without the GCS client installed
        return False
    return isinstance(exc, DataCorruption) or bool(_should_retry(exc))


def _is_precondition_failed(exc: BaseException) -> bool:
    code = getattr(exc, "code", None)
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return code == 412 or status == 412


def _is_not_found(exc: BaseException) -> bool:
    code = getattr(exc, "code", None)
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return code == 404 or status == 404


class _ClientHolder:
    """Creates the GCS client on first use; shared by a store and its child views."""

    def __init__(self, client: Any | None, pool_size: int) -> None:
        self._client = client
        self._owned = client is None
        self._pool_size = pool_size
        self._lock = threading.Lock()

    def get(self) -> Any:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = _default_client(self._pool_size)
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        if not self._owned:
            raise TypeError("a GCSStore built on a caller-supplied client cannot be pickled")
        return {"pool_size": self._pool_size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None, state["pool_size"])


def _default_client(pool_size: int) -> Any:
    from google.cloud import storage

    client = storage.Client()
    # Shard uploads run in parallel threads; the default pool of 10 would churn connections.
    session = getattr(client, "_http", None)
    if session is not None and hasattr(session, "mount"):
        import requests.adapters

        adapter = requests.adapters.HTTPAdapter(pool_connections=pool_size, pool_maxsize=pool_size)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
    return client


class _Exists(Exception):
    """Internal: a create-only write found the object already there."""


class GCSStore(ObjectStore):
    """``gs://bucket/prefix`` as an object store.

    ``client``: a ``google.cloud.storage.Client`` (default: created lazily from the
    environment; honours STORAGE_EMULATOR_HOST). ``retry``: the policy for transient failures.
    ``timeout_s``: per HTTP request (connect, read). ``chunk_size``: resumable upload chunk
    (None: one request per file). ``retries`` counts retried attempts (shared with children).
    """

    URL_FORMS = "gs://bucket/prefix"

    @classmethod
    def from_url(cls, url: StorageUrl, **options: Any) -> GCSStore:
        return cls(url.bucket, url.key, **options)

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any | None = None,
        retry: RetryPolicy | None = None,
        timeout_s: float | tuple[float, float] = (10.0, 120.0),
        chunk_size: int | None = None,
        pool_size: int = 32,
        sleep: Callable[[float], None] = time.sleep,
        _holder: _ClientHolder | None = None,
        _retries: _Counter | None = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"GCS bucket name must be non-empty without '/', got {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        if chunk_size is not None and chunk_size % (256 * 1024):
            raise ValueError(f"chunk_size must be a multiple of 256 KiB, got {chunk_size}")
        self._bucket_name = bucket
        self._prefix = prefix
        self._holder = _holder or _ClientHolder(client, pool_size)
        self._policy = retry or RetryPolicy()
        self._timeout = timeout_s
        self._chunk_size = chunk_size
        self._sleep = sleep
        self._retries = _retries or _Counter()
        self._rng = random.Random()

    @property
    def url(self) -> str:
        return (
            f"gs://{self._bucket_name}/{self._prefix}"
            if self._prefix
            else f"gs://{self._bucket_name}"
        )

    @property
    def bucket_name(self) -> str:
        return self._bucket_name

    @property
    def retries(self) -> int:
        return self._retries.value

    @property
    def client(self) -> Any:
        return self._holder.get()

    def object_name(self, key: str) -> str:
        """Full object name inside the bucket."""
        return _join(self._prefix, validate_key(key))

    def child(self, prefix: str) -> GCSStore:
        return GCSStore(
            self._bucket_name,
            _join(self._prefix, validate_key(prefix.strip("/"))),
            retry=self._policy,
            timeout_s=self._timeout,
            chunk_size=self._chunk_size,
            sleep=self._sleep,
            _holder=self._holder,
            _retries=self._retries,
        )

    # -- plumbing

    def _blob(self, name: str) -> Any:
        # A fresh Blob per attempt: Blob objects carry per-request state and are not
        # thread-safe.
        return self.client.bucket(self._bucket_name).blob(name, chunk_size=self._chunk_size)

    def _retry(self, op: str, key: str, fn: Callable[[], T]) -> T:
        return call_with_retry(
            fn,
            what=f"{op} {self.url_of(key)}",
            policy=self._policy,
            is_transient=_gcs_is_transient,
            sleep=self._sleep,
            rng=self._rng,
            on_retry=lambda _exc: self._retries.add(),
        )

    def _upload_options(self, if_generation_match: int) -> dict[str, Any]:
        # Every upload is conditional and checksummed; retries are ours (call_with_retry).
        return {
            "content_type": "application/octet-stream",
            "if_generation_match": if_generation_match,
            "checksum": "crc32c",
            "retry": None,
            "timeout": self._timeout,
        }

    def _token_of(self, name: str) -> str | None:
        blob = self.client.bucket(self._bucket_name).get_blob(
            name, retry=None, timeout=self._timeout
        )
        return None if blob is None else (blob.metadata or {}).get(WRITE_TOKEN_KEY)

    def _conditional_write(
        self,
        op: str,
        key: str,
        upload: Callable[[Any, int], None],
        if_generation_match: int,
        precheck: bool,
    ) -> bool:
        """Upload with ``ifGenerationMatch``; resolve lost responses with a per-call token."""
        name = self.object_name(key)
        token = uuid.uuid4().hex
        maybe_landed = False  # an earlier attempt failed in a way that may have committed

        def attempt() -> bool:
            nonlocal maybe_landed
            try:
                # Cheap existence probe before streaming a big file (also covers emulators
                # that ignore preconditions on resumable uploads).
                if precheck and self._blob(name).exists(retry=None, timeout=self._timeout):
                    raise _Exists
                blob = self._blob(name)
                blob.metadata = {WRITE_TOKEN_KEY: token}
                upload(blob, if_generation_match)
                return True
            except _Exists:
                return maybe_landed and self._token_of(name) == token
            except Exception as exc:
                if _is_precondition_failed(exc) or (if_generation_match and _is_not_found(exc)):
                    # Our own earlier attempt may be what makes the precondition fail now.
                    return maybe_landed and self._token_of(name) == token
                if _gcs_is_transient(exc):
                    maybe_landed = True
                raise

        return self._retry(op, key, attempt)

    # -- operations

    def write_new(self, key: str, data: bytes) -> bool:
        try:
            from google.cloud.storage.blob import _MAX_MULTIPART_SIZE
        except ImportError:  # pragma: no cover - private constant moved
            _MAX_MULTIPART_SIZE = 8 << 20

        def upload(blob: Any, igm: int) -> None:
            blob.upload_from_string(data, **self._upload_options(igm))

        return self._conditional_write(
            "write_new", key, upload, 0, precheck=len(data) > _MAX_MULTIPART_SIZE
        )

    def write_new_file(self, key: str, local_path: str | os.PathLike[str]) -> bool:
        path = os.fspath(local_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"write_new_file {self.url_of(key)}: no local file {path}")

        def upload(blob: Any, igm: int) -> None:
            blob.upload_from_filename(path, **self._upload_options(igm))

        return self._conditional_write("write_new_file", key, upload, 0, precheck=True)

    def compare_and_swap(self, key: str, data: bytes, expected_generation: int | None) -> bool:
        if expected_generation is not None and expected_generation <= 0:
            return False  # GCS generations are positive; 0 would mean "must not exist"

        def upload(blob: Any, igm: int) -> None:
            blob.upload_from_string(data, **self._upload_options(igm))

        igm = 0 if expected_generation is None else expected_generation
        return self._conditional_write("compare_and_swap", key, upload, igm, precheck=False)

    def read(self, key: str) -> bytes:
        name = self.object_name(key)

        def attempt() -> bytes:
            try:
                return self._blob(name).download_as_bytes(
                    checksum="crc32c", retry=None, timeout=self._timeout
                )
            except Exception as exc:
                if _is_not_found(exc):
                    raise ObjectNotFound(self.url_of(key)) from None
                raise

        return self._retry("read", key, attempt)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """An HTTP Range read (``end`` is inclusive in the client's API). No checksum here:
        GCS's crc32c covers the whole object, so the caller verifies the assembled bytes."""
        if start < 0 or length < 0:
            raise ValueError(f"read_range needs start >= 0 and length >= 0, got {start}, {length}")
        if length == 0:
            return b""
        name = self.object_name(key)

        def attempt() -> bytes:
            try:
                return self._blob(name).download_as_bytes(
                    start=start,
                    end=start + length - 1,
                    checksum=None,
                    retry=None,
                    timeout=self._timeout,
                )
            except Exception as exc:
                if _is_not_found(exc):
                    raise ObjectNotFound(self.url_of(key)) from None
                raise

        return self._retry("read_range", key, attempt)

    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        name = self.object_name(key)

        def attempt() -> tuple[bytes, int] | None:
            try:
                blob = self._blob(name)
                data = blob.download_as_bytes(checksum="crc32c", retry=None, timeout=self._timeout)
                if blob.generation is not None:
                    # Generation from the same response as the bytes: consistent by construction.
                    return data, int(blob.generation)
                # No generation header (unusual proxy): pin the generation, then read it.
                meta = self.client.bucket(self._bucket_name).get_blob(
                    name, retry=None, timeout=self._timeout
                )
                if meta is None:
                    return None
                pinned = self.client.bucket(self._bucket_name).blob(
                    name, generation=meta.generation
                )
                data = pinned.download_as_bytes(
                    checksum="crc32c", retry=None, timeout=self._timeout
                )
                return data, int(meta.generation)
            except Exception as exc:
                if _is_not_found(exc):
                    return None
                raise

        return self._retry("read_versioned", key, attempt)

    def read_to_file(self, key: str, local_path: str | os.PathLike[str]) -> None:
        name = self.object_name(key)
        dest = os.path.abspath(os.fspath(local_path))
        os.makedirs(os.path.dirname(dest), exist_ok=True)

        def attempt() -> None:
            tmp = f"{dest}.{_TMP_PREFIX}{uuid.uuid4().hex}"
            try:
                self._blob(name).download_to_filename(
                    tmp, checksum="crc32c", retry=None, timeout=self._timeout
                )
                os.replace(tmp, dest)
            except Exception as exc:
                if _is_not_found(exc):
                    raise ObjectNotFound(self.url_of(key)) from None
                raise
            finally:
                _unlink_quiet(tmp)

        self._retry("read_to_file", key, attempt)

    def exists(self, key: str) -> bool:
        name = self.object_name(key)
        return self._retry(
            "exists", key, lambda: bool(self._blob(name).exists(retry=None, timeout=self._timeout))
        )

    def list(self, prefix: str = "") -> list[str]:
        return [info.key for info in self._listing("list", prefix)]

    def list_info(self, prefix: str = "") -> list[ObjectInfo]:
        return self._listing("list_info", prefix)

    def _listing(self, op: str, prefix: str) -> list[ObjectInfo]:
        prefix = _validate_prefix(prefix)
        full = (
            _join(self._prefix, prefix) if prefix else (self._prefix + "/" if self._prefix else "")
        )
        strip = len(self._prefix) + 1 if self._prefix else 0

        def attempt() -> list[ObjectInfo]:
            blobs = self.client.list_blobs(
                self._bucket_name, prefix=full, retry=None, timeout=self._timeout
            )
            # Names ending in '/' are console "folder" placeholders, not objects of ours.
            found = [
                ObjectInfo(b.name[strip:], int(b.size or 0), int(b.generation or 0))
                for b in blobs
                if not b.name.endswith("/")
            ]
            return sorted(found, key=lambda info: info.key)

        return self._retry(op, prefix or "", attempt)

    def delete(self, key: str) -> None:
        name = self.object_name(key)

        def attempt() -> None:
            try:
                self._blob(name).delete(retry=None, timeout=self._timeout)
            except Exception as exc:
                if not _is_not_found(exc):  # missing (or deleted by our lost attempt) is fine
                    raise

        self._retry("delete", key, attempt)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_rng", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._rng = random.Random()
