"""Object storage used as the parameter server between the trainer and the rollout fleet.

One small interface, ``ObjectStore``, with two backends:

* ``LocalStore``: a directory. Create-only writes go to a temp file that is then hard-linked to
  its final name, so a reader never sees a partial object and a SIGKILL at any point leaves
  either no object or a complete one. Compare-and-swap takes an ``flock`` on the object's
  directory (released by the kernel when a process dies) and keeps generations in a per
  directory state file; a CAS interrupted between its rename and its state update is detected
  from the object's inode fingerprint and given a fresh generation, never an old one.
* ``GCSStore``: a GCS bucket/prefix. Create-only and CAS use ``ifGenerationMatch``. The client
  library's own retries are switched off; ``call_with_retry`` retries transient failures (429,
  408, 5xx, connection resets, timeouts) with bounded exponential backoff and jitter. A
  conditional write whose response was lost is resolved on retry with a per-call token stored
  in the object's metadata, so a retry never reports our own write as lost and never claims a
  write by someone else.

``FlakyStore`` injects transient faults (before or after the real operation) and
``RetryingStore`` is the same retry layer for any store, used in tests and for wrappers.

``google.cloud.storage`` is imported lazily: importing this module stays cheap.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import json
import logging
import os
import random
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

__all__ = [
    "GCSStore",
    "FlakyStore",
    "LocalStore",
    "ObjectNotFound",
    "ObjectStore",
    "RESERVED_PREFIX",
    "RetryPolicy",
    "RetryingStore",
    "StorageError",
    "TransientStorageError",
    "call_with_retry",
    "open_store",
    "validate_key",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Names starting with this are the store's own bookkeeping (temp files, generation state);
# they are rejected as keys and never listed.
RESERVED_PREFIX = ".rlax."
_TMP_PREFIX = RESERVED_PREFIX + "tmp."
_STATE_NAME = RESERVED_PREFIX + "generations.json"
# Custom-metadata key holding the per-call token of a conditional GCS write.
WRITE_TOKEN_KEY = "rlax-write-token"
_COPY_CHUNK = 8 << 20


class StorageError(Exception):
    """A storage operation failed permanently (or gave up after bounded retries)."""


class ObjectNotFound(StorageError):
    """The object does not exist; ``url`` names it in full."""

    def __init__(self, url: str) -> None:
        super().__init__(f"object not found: {url}")
        self.url = url


class TransientStorageError(StorageError):
    """A failure worth retrying (throttling, 5xx, lost connection, timeout)."""


# --------------------------------------------------------------------------- keys


def validate_key(key: str) -> str:
    """Check an object key: '/'-separated, non-empty segments, no '.', '..' or reserved names."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty str, got {key!r}")
    if "\x00" in key:
        raise ValueError(f"object key {key!r} contains NUL")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(
                f"invalid object key {key!r}: segments must be non-empty and not '.' or '..' "
                "(no leading, trailing or doubled '/')"
            )
        if part.startswith(RESERVED_PREFIX):
            raise ValueError(
                f"invalid object key {key!r}: names starting with {RESERVED_PREFIX!r} are "
                "reserved for the store's bookkeeping"
            )
    return key


def safe_name(text: str, default: str = "run") -> str:
    """`text` as one key segment of safe characters:
    `manual__2026-01-05T10:00:00+00:00` -> `manual__2026-01-05T10-00-00-00-00`."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or default


def _validate_prefix(prefix: str) -> str:
    """A list prefix is a key, possibly partial in its last segment or ending with '/'."""
    if not isinstance(prefix, str):
        raise ValueError(f"list prefix must be a str, got {prefix!r}")
    if not prefix:
        return prefix
    if prefix.startswith("/"):
        raise ValueError(f"invalid list prefix {prefix!r}: must be relative to the store")
    head = prefix.rpartition("/")[0]
    if head:
        validate_key(head)  # complete segments follow the key rules; the last may be partial
    return prefix


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


# --------------------------------------------------------------------------- retry


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


class _Counter:
    """Thread-safe counter shared between a store and its child views."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.value += n

    def __getstate__(self) -> dict[str, int]:
        return {"value": self.value}

    def __setstate__(self, state: dict[str, int]) -> None:
        self._lock = threading.Lock()
        self.value = state["value"]


# --------------------------------------------------------------------------- interface


class ObjectStore(abc.ABC):
    """Keys are '/'-separated and relative to the store's prefix (see ``validate_key``)."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where this store is rooted: ``file:///abs/dir`` or ``gs://bucket/prefix``."""

    def url_of(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    @abc.abstractmethod
    def write_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data``; False (nothing written) if it already exists."""

    @abc.abstractmethod
    def write_new_file(self, key: str, local_path: str | os.PathLike[str]) -> bool:
        """Create ``key`` from a local file, streaming it; False if ``key`` already exists."""

    @abc.abstractmethod
    def read(self, key: str) -> bytes:
        """Whole object; ``ObjectNotFound`` (naming the full url) if missing."""

    @abc.abstractmethod
    def read_to_file(self, key: str, local_path: str | os.PathLike[str]) -> None:
        """Stream an object to a local file (replaced atomically); ``ObjectNotFound`` if missing."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with ``prefix`` (plain string prefix, like GCS)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; a missing object is fine."""

    @abc.abstractmethod
    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        """(data, generation) read consistently, or None if missing."""

    @abc.abstractmethod
    def compare_and_swap(self, key: str, data: bytes, expected_generation: int | None) -> bool:
        """Replace ``key`` iff its generation is ``expected_generation`` (None: must not exist).

        True means our write landed. False means it did not, or (after a lost response) it
        landed and was already replaced by a later CAS; either way the caller re-reads.
        """

    @abc.abstractmethod
    def child(self, prefix: str) -> ObjectStore:
        """A view of the keys under ``prefix``/."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


# --------------------------------------------------------------------------- local


class LocalStore(ObjectStore):
    """A directory as an object store (see the module docstring for the crash-safety design).

    ``fsync=True`` also survives power loss (data and directory entries are fsynced); without
    it every operation is still atomic with respect to process crashes (SIGKILL).
    Requires a local POSIX filesystem with hard links and ``flock`` (not NFS).
    A local store cannot hold both ``a`` and ``a/b`` (a file cannot be a directory).
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self._root = os.path.abspath(os.fspath(root))
        self._fsync = fsync

    @property
    def root(self) -> str:
        return self._root

    @property
    def url(self) -> str:
        return "file://" + self._root

    def path_of(self, key: str) -> str:
        """The file holding ``key`` (for tests and tools that need the raw bytes)."""
        return os.path.join(self._root, *validate_key(key).split("/"))

    def child(self, prefix: str) -> LocalStore:
        return LocalStore(self.path_of(prefix.strip("/")), fsync=self._fsync)

    # -- create-only

    def write_new(self, key: str, data: bytes) -> bool:
        view = memoryview(data)
        return self._create(key, lambda f: f.write(view))

    def write_new_file(self, key: str, local_path: str | os.PathLike[str]) -> bool:
        with open(local_path, "rb") as src:
            return self._create(key, lambda f: shutil.copyfileobj(src, f, _COPY_CHUNK))

    def _create(self, key: str, fill: Callable[[BinaryIO], Any]) -> bool:
        path = self.path_of(key)
        parent = os.path.dirname(path)
        self._makedirs(parent, key)
        tmp = self._write_temp(parent, fill, key)
        try:
            try:
                # link() fails if the name exists: the create-only commit point. The object
                # appears complete or not at all.
                os.link(tmp, path)
            except FileExistsError:
                if os.path.isdir(path):
                    raise StorageError(
                        f"cannot create {self.url_of(key)}: a local store holds keys under "
                        f"{key}/ so {key} cannot also be an object"
                    ) from None
                return False
            except OSError as exc:
                raise StorageError(
                    f"write_new {self.url_of(key)} failed: {exc} (the local store needs a "
                    "filesystem with hard links)"
                ) from exc
            self._sync_dir(parent)
            return True
        finally:
            _unlink_quiet(tmp)

    # -- reads

    def read(self, key: str) -> bytes:
        try:
            with open(self.path_of(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(self.url_of(key)) from None

    def read_to_file(self, key: str, local_path: str | os.PathLike[str]) -> None:
        dest = os.path.abspath(os.fspath(local_path))
        try:
            src = open(self.path_of(key), "rb")  # noqa: SIM115 - closed below
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(self.url_of(key)) from None
        with src:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            tmp = f"{dest}.{_TMP_PREFIX}{uuid.uuid4().hex}"
            try:
                with open(tmp, "xb") as out:
                    shutil.copyfileobj(src, out, _COPY_CHUNK)
                os.replace(tmp, dest)
            finally:
                _unlink_quiet(tmp)

    def exists(self, key: str) -> bool:
        return os.path.isfile(self.path_of(key))

    def list(self, prefix: str = "") -> list[str]:
        prefix = _validate_prefix(prefix)
        base_rel = prefix.rpartition("/")[0]
        base = os.path.join(self._root, *base_rel.split("/")) if base_rel else self._root
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            rel = os.path.relpath(dirpath, self._root)
            rel = "" if rel == "." else rel.replace(os.sep, "/")
            # Descend only into directories that can still hold keys matching the prefix.
            dirnames[:] = [
                d
                for d in dirnames
                if not d.startswith(RESERVED_PREFIX)
                and (
                    _join(rel, d + "/").startswith(prefix) or prefix.startswith(_join(rel, d + "/"))
                )
            ]
            for name in filenames:
                if name.startswith(RESERVED_PREFIX):
                    continue
                key = _join(rel, name)
                if key.startswith(prefix):
                    keys.append(key)
        keys.sort()
        return keys

    # -- generations and CAS

    def delete(self, key: str) -> None:
        path = self.path_of(key)
        parent, name = os.path.split(path)
        if not os.path.isdir(parent):
            return
        with self._dir_lock(parent):
            # Forget the generation before unlinking: a crash in between leaves an object with
            # no recorded generation, which simply gets a fresh one (never a reused one).
            state = self._load_state(parent)
            if name in state["objects"]:
                del state["objects"][name]
                self._save_state(parent, state)
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(path)
            self._sync_dir(parent)

    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        path = self.path_of(key)
        parent, name = os.path.split(path)
        if not os.path.isdir(parent):
            return None
        with self._dir_lock(parent):
            state = self._load_state(parent)
            try:
                f = open(path, "rb")  # noqa: SIM115 - closed below
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                if state["objects"].pop(name, None) is not None:
                    self._save_state(parent, state)
                return None
            with f:
                st = os.fstat(f.fileno())
                data = f.read()
            generation, changed = _observe(state, name, st)
            if changed:
                self._save_state(parent, state)
            return data, generation

    def compare_and_swap(self, key: str, data: bytes, expected_generation: int | None) -> bool:
        path = self.path_of(key)
        parent, name = os.path.split(path)
        self._makedirs(parent, key)
        with self._dir_lock(parent):
            state = self._load_state(parent)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            if st is not None and not _is_regular(st):
                raise StorageError(
                    f"cannot CAS {self.url_of(key)}: keys exist under {key}/ in a local store"
                )
            current, changed = _observe(state, name, st) if st is not None else (None, False)
            if current != expected_generation:
                if changed:
                    self._save_state(parent, state)
                return False
            view = memoryview(data)
            tmp = self._write_temp(parent, lambda f: f.write(view), key)
            try:
                fingerprint = os.stat(tmp)
                if expected_generation is None:
                    try:
                        os.link(tmp, path)  # a lock-free write_new may have won meanwhile
                    except FileExistsError:
                        return False
                else:
                    # Atomic replace. If we die before the state is saved, the new inode
                    # will not match the recorded fingerprint and gets a fresh generation.
                    os.replace(tmp, path)
            finally:
                _unlink_quiet(tmp)
            state["objects"][name] = [_next_generation(state), *_fingerprint(fingerprint)]
            self._save_state(parent, state)
            self._sync_dir(parent)
            return True

    # -- housekeeping

    def remove_stale_temp_files(self, older_than_s: float = 3600.0) -> int:
        """Delete temp files left by killed writers; returns how many were removed."""
        cutoff = time.time() - older_than_s
        removed = 0
        for dirpath, _dirs, filenames in os.walk(self._root):
            for name in filenames:
                if name.startswith(_TMP_PREFIX):
                    p = os.path.join(dirpath, name)
                    with contextlib.suppress(FileNotFoundError):
                        if os.stat(p).st_mtime < cutoff:
                            os.unlink(p)
                            removed += 1
        return removed

    # -- internals

    def _makedirs(self, parent: str, key: str) -> None:
        try:
            os.makedirs(parent, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise StorageError(
                f"cannot create {self.url_of(key)}: a parent of it is an object in this local "
                f"store ({exc})"
            ) from exc

    def _write_temp(self, parent: str, fill: Callable[[BinaryIO], Any], key: str) -> str:
        tmp = os.path.join(parent, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "xb") as f:
                fill(f)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException as exc:
            _unlink_quiet(tmp)
            if isinstance(exc, OSError):
                raise StorageError(f"writing {self.url_of(key)} failed: {exc}") from exc
            raise
        return tmp

    def _sync_dir(self, parent: str) -> None:
        if self._fsync:
            fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def _dir_lock(self, parent: str) -> Iterator[None]:
        # flock on the directory itself: no lock files to clean up, every open() is its own
        # lock owner (so threads exclude each other too), released by the kernel on death.
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _load_state(self, parent: str) -> dict[str, Any]:
        try:
            with open(os.path.join(parent, _STATE_NAME), "rb") as f:
                state = json.loads(f.read())
            if isinstance(state.get("counter"), int) and isinstance(state.get("objects"), dict):
                return state
        except FileNotFoundError:
            pass
        except ValueError:
            # Unreadable state: forgetting generations is safe, every object gets a fresh one.
            log.warning("discarding unreadable generation state in %s", parent)
        return {"counter": 0, "objects": {}}

    def _save_state(self, parent: str, state: dict[str, Any]) -> None:
        tmp = self._write_temp(parent, lambda f: f.write(json.dumps(state).encode()), _STATE_NAME)
        try:
            os.replace(tmp, os.path.join(parent, _STATE_NAME))
        finally:
            _unlink_quiet(tmp)


def _is_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)


def _fingerprint(st: os.stat_result) -> list[int]:
    # A CAS renames a temp file created while the old object was still linked, so the new
    # object's inode number always differs from the recorded one.
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _next_generation(state: dict[str, Any]) -> int:
    # Monotonic per directory and seeded from the clock (microseconds, like GCS), so a
    # generation is never reused even if the state file or the directory is recreated.
    generation = max(state["counter"] + 1, time.time_ns() // 1000)
    state["counter"] = generation
    return generation


def _observe(state: dict[str, Any], name: str, st: os.stat_result) -> tuple[int, bool]:
    """Generation of the object with stat ``st``; assigns a fresh one if it is not recorded."""
    entry = state["objects"].get(name)
    fingerprint = _fingerprint(st)
    if entry is not None and entry[1:] == fingerprint:
        return entry[0], False
    generation = _next_generation(state)
    state["objects"][name] = [generation, *fingerprint]
    return generation, True


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# --------------------------------------------------------------------------- GCS

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
            blob.upload_from_string(
                data,
                content_type="application/octet-stream",
                if_generation_match=igm,
                checksum="crc32c",
                retry=None,
                timeout=self._timeout,
            )

        return self._conditional_write(
            "write_new", key, upload, 0, precheck=len(data) > _MAX_MULTIPART_SIZE
        )

    def write_new_file(self, key: str, local_path: str | os.PathLike[str]) -> bool:
        path = os.fspath(local_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"write_new_file {self.url_of(key)}: no local file {path}")

        def upload(blob: Any, igm: int) -> None:
            blob.upload_from_filename(
                path,
                content_type="application/octet-stream",
                if_generation_match=igm,
                checksum="crc32c",
                retry=None,
                timeout=self._timeout,
            )

        return self._conditional_write("write_new_file", key, upload, 0, precheck=True)

    def compare_and_swap(self, key: str, data: bytes, expected_generation: int | None) -> bool:
        if expected_generation is not None and expected_generation <= 0:
            return False  # GCS generations are positive; 0 would mean "must not exist"

        def upload(blob: Any, igm: int) -> None:
            blob.upload_from_string(
                data,
                content_type="application/octet-stream",
                if_generation_match=igm,
                checksum="crc32c",
                retry=None,
                timeout=self._timeout,
            )

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
        prefix = _validate_prefix(prefix)
        full = (
            _join(self._prefix, prefix) if prefix else (self._prefix + "/" if self._prefix else "")
        )
        strip = len(self._prefix) + 1 if self._prefix else 0

        def attempt() -> list[str]:
            blobs = self.client.list_blobs(
                self._bucket_name, prefix=full, retry=None, timeout=self._timeout
            )
            # Names ending in '/' are console "folder" placeholders, not objects of ours.
            return sorted(b.name[strip:] for b in blobs if not b.name.endswith("/"))

        return self._retry("list", prefix or "", attempt)

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


# --------------------------------------------------------------------------- wrappers


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


# --------------------------------------------------------------------------- factory

_ALLOWED = "a local path (/abs/dir or relative/dir), file:///abs/dir, or gs://bucket/prefix"


def open_store(url: str | os.PathLike[str], **options: Any) -> ObjectStore:
    """Open a store by URL: local paths and ``file://`` -> LocalStore, ``gs://`` -> GCSStore.

    ``options`` go to the backend's constructor (e.g. ``fsync=True``, ``retry=RetryPolicy()``).
    """
    s = os.fspath(url)
    if not isinstance(s, str) or not s:
        raise ValueError(f"storage url must be non-empty; allowed: {_ALLOWED}")
    if s.startswith("gs://"):
        bucket, _, prefix = s[len("gs://") :].partition("/")
        if not bucket:
            raise ValueError(f"storage url {s!r} names no bucket; expected gs://bucket/prefix")
        return GCSStore(bucket, prefix, **options)
    if s.startswith("file://"):
        rest = s[len("file://") :]
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest.startswith("/"):
            raise ValueError(
                f"storage url {s!r}: file:// urls must be absolute (file:///abs/dir); "
                f"allowed: {_ALLOWED}"
            )
        return LocalStore(rest, **options)
    if "://" in s:
        scheme = s.split("://", 1)[0]
        raise ValueError(f"unsupported storage url scheme {scheme!r} in {s!r}; allowed: {_ALLOWED}")
    return LocalStore(s, **options)
