"""The URL scheme -> backend table, and what dispatches through it.

``open_store`` opens any registered URL, ``open_parent`` the store holding one object, and
``glob`` matches a local or remote pattern. A new backend is one module with an
``ObjectStore`` subclass (``URL_FORMS`` and ``from_url`` set) and one line in ``BACKENDS``.
"""

from __future__ import annotations

import fnmatch
import glob as _fs_glob
import os
from dataclasses import dataclass
from typing import Any

from pipeline.storage.base import ObjectStore
from pipeline.storage.gcs import GCSStore
from pipeline.storage.local import LocalStore
from pipeline.storage.memory import MemoryStore
from pipeline.storage.urls import LOCAL_SCHEME, StorageUrlError, local_path, split_url

BACKENDS: dict[str, type[ObjectStore]] = {
    LOCAL_SCHEME: LocalStore,
    "gs": GCSStore,
    "memory": MemoryStore,
}

GLOB_CHARS = "*?["


def _allowed() -> str:
    return ", ".join(backend.URL_FORMS for backend in BACKENDS.values())


def open_store(url: str | os.PathLike[str], **options: Any) -> ObjectStore:
    """Open a store by URL with the backend ``BACKENDS`` holds for its scheme (a URL without
    ``://`` is a local path).

    ``options`` go to the backend's constructor (e.g. ``fsync=True``, ``retry=RetryPolicy()``).
    """
    s = os.fspath(url)
    if not isinstance(s, str) or not s:
        raise StorageUrlError(f"storage url must be non-empty; allowed: {_allowed()}")
    parsed = split_url(s)
    backend = BACKENDS.get(parsed.scheme)
    if backend is None:
        raise StorageUrlError(
            f"unsupported storage url scheme {parsed.scheme!r} in {s!r}; registered schemes: "
            f"{', '.join(BACKENDS)}; allowed: {_allowed()}"
        )
    return backend.from_url(parsed, **options)


def open_parent(url: str) -> tuple[ObjectStore, str]:
    """The store holding the object at ``url`` and its key there: for a local file its
    directory and its name, for a remote object its bucket and its full name."""
    path = local_path(url.rstrip("/"))
    if path is not None:
        path = os.path.abspath(path)
        return open_store(os.path.dirname(path)), os.path.basename(path)
    parsed = split_url(url.rstrip("/"))
    return open_store(parsed.root), parsed.key


@dataclass(frozen=True)
class Match:
    """One file a glob matched: an absolute local path or a full URL, its size in bytes and
    a version that changes when it is rewritten (local: mtime in ns; remote: generation)."""

    url: str
    size: int
    version: int


def glob(pattern: str) -> list[Match]:
    """Files matching a local or remote glob (``*``, ``?``, ``[...]``; locally ``**`` spans
    directories; remotely ``*`` also matches ``/``, as in ``fnmatch``), sorted by url."""
    path = local_path(pattern)
    if path is not None:
        found = []
        for p in _fs_glob.glob(os.path.abspath(path), recursive=True):
            if os.path.isfile(p):
                st = os.stat(p)
                found.append(Match(os.path.abspath(p), st.st_size, st.st_mtime_ns))
        return sorted(found, key=lambda m: m.url)
    parsed = split_url(pattern)
    # List from the longest fixed prefix, then match the full names.
    cut = min((parsed.key.index(c) for c in GLOB_CHARS if c in parsed.key), default=len(parsed.key))
    store = open_store(parsed.root)
    return [
        Match(store.url_of(info.key), info.size, info.generation)
        for info in store.list_info(parsed.key[:cut])
        if fnmatch.fnmatchcase(info.key, parsed.key)
    ]
