"""Storage URLs, parsed in one place: ``scheme://bucket/key`` or a local path.

A URL without ``://`` is a local path (relative to the working directory, or absolute);
``file:///abs/dir`` (or ``file://localhost/abs/dir``) names the same directory. Every other
scheme (``gs``, ``memory``, ...) names a bucket (a store's name) and a key or prefix in it.
This module knows URL syntax only; which schemes exist is the registry's business.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

LOCAL_SCHEME = "file"


class StorageUrlError(ValueError):
    """A URL no store can be opened at (empty, relative file://, no bucket, an unknown
    scheme, '.'/'..' in a bucket's prefix); the message names it and what is allowed."""


class StorageUrl(NamedTuple):
    """A parsed storage URL. For ``file``: no bucket, ``key`` is the filesystem path."""

    scheme: str
    bucket: str
    key: str

    @property
    def root(self) -> str:
        """``scheme://bucket``: the URL of the whole bucket (for non-local schemes)."""
        return f"{self.scheme}://{self.bucket}"


def split_url(url: str | os.PathLike[str]) -> StorageUrl:
    """``gs://bucket/a/b`` -> ``StorageUrl("gs", "bucket", "a/b")``; ``/abs/dir``,
    ``rel/dir`` and ``file:///abs/dir`` -> ``StorageUrl("file", "", path)``.

    Raises ``StorageUrlError`` for an empty URL, a relative ``file://`` URL, a missing
    bucket, or a prefix with empty, '.' or '..' segments (object names are literal: no
    store resolves them, and GCS would make them part of the name).
    """
    s = os.fspath(url)
    if not isinstance(s, str) or not s:
        raise StorageUrlError(f"storage url must be a non-empty str, got {s!r}")
    if "://" not in s:
        return StorageUrl(LOCAL_SCHEME, "", s)
    scheme, rest = s.split("://", 1)
    if scheme == LOCAL_SCHEME:
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest.startswith("/"):
            raise StorageUrlError(
                f"storage url {s!r}: file:// urls must be absolute (file:///abs/dir)"
            )
        return StorageUrl(LOCAL_SCHEME, "", rest)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageUrlError(
            f"storage url {s!r} names no bucket; expected {scheme}://bucket/prefix"
        )
    bad = [part for part in key.rstrip("/").split("/") if part in ("", ".", "..")] if key else []
    if bad:
        raise StorageUrlError(
            f"storage url {s!r}: prefix segment {bad[0]!r} is not allowed; allowed: "
            f"{scheme}://bucket/a/b with non-empty segments other than '.' and '..'"
        )
    return StorageUrl(scheme, bucket, key)


def local_path(url: str | os.PathLike[str]) -> Path | None:
    """The filesystem path a local URL names (``file://`` removed, a relative path left
    relative), or None for a remote URL (``gs://...``)."""
    parsed = split_url(url)
    return Path(parsed.key) if parsed.scheme == LOCAL_SCHEME else None
