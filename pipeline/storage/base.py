"""The storage interface: ``ObjectStore``, its errors and the rules for object keys.

Every backend (``local``, ``gcs``, ``memory``) and wrapper (``retry``, ``faults``) implements
``ObjectStore``; callers see only this module's names.
"""

from __future__ import annotations

import abc
import contextlib
import os
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, ClassVar, TypeVar

from pipeline.storage.urls import StorageUrl

T = TypeVar("T")

# Names starting with this are the store's own bookkeeping (temp files, generation state);
# they are rejected as keys and never listed.
RESERVED_PREFIX = ".rlax."
_TMP_PREFIX = RESERVED_PREFIX + "tmp."
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


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _write_replacing(local_path: str | os.PathLike[str], fill: Callable[[BinaryIO], Any]) -> None:
    """Write a local file through a temp file beside it: a reader (or a crash) sees the old
    file or the whole new one, never a part."""
    dest = os.path.abspath(os.fspath(local_path))
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f"{dest}.{_TMP_PREFIX}{uuid.uuid4().hex}"
    try:
        with open(tmp, "xb") as out:
            fill(out)
        os.replace(tmp, dest)
    finally:
        _unlink_quiet(tmp)


# --------------------------------------------------------------------------- interface


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key, its size in bytes and its generation (as ``read_versioned``
    gives it), so a listing can fingerprint what it found."""

    key: str
    size: int
    generation: int


class ObjectStore(abc.ABC):
    """Keys are '/'-separated and relative to the store's prefix (see ``validate_key``).

    A backend that ``open_store`` can open by URL also sets ``URL_FORMS`` (how its URLs look,
    for error messages) and implements ``from_url``; wrappers need neither.
    """

    URL_FORMS: ClassVar[str] = ""

    @classmethod
    def from_url(cls, url: StorageUrl, **options: Any) -> ObjectStore:
        """The store a parsed URL names; ``options`` go to the constructor."""
        raise TypeError(f"{cls.__name__} is not opened by URL")

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where this store is rooted: ``file:///abs/dir``, ``gs://bucket/prefix``, ..."""

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

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of an object from byte ``start`` (fewer at its end);
        ``ObjectNotFound`` if missing. This default reads the whole object; backends that can
        read a range (an HTTP Range request, ``pread``) override it, so several ranges of one
        large object can be fetched in parallel."""
        if start < 0 or length < 0:
            raise ValueError(f"read_range needs start >= 0 and length >= 0, got {start}, {length}")
        return bytes(self.read(key)[start : start + length])

    @abc.abstractmethod
    def read_to_file(self, key: str, local_path: str | os.PathLike[str]) -> None:
        """Stream an object to a local file (replaced atomically); ``ObjectNotFound`` if missing."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with ``prefix`` (plain string prefix, like GCS)."""

    def list_info(self, prefix: str = "") -> list[ObjectInfo]:
        """``list(prefix)`` with each object's size and generation.

        This default reads every object (correct for any store); backends whose listing
        carries sizes and generations override it with one listing.
        """
        infos = []
        for key in self.list(prefix):
            found = self.read_versioned(key)
            if found is not None:  # deleted since the listing: not there any more
                infos.append(ObjectInfo(key, len(found[0]), found[1]))
        return infos

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
