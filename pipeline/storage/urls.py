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

    Raises ``ValueError`` for an empty URL, a relative ``file://`` URL or a missing bucket.
    """
    s = os.fspath(url)
    if not isinstance(s, str) or not s:
        raise ValueError(f"storage url must be a non-empty str, got {s!r}")
    if "://" not in s:
        return StorageUrl(LOCAL_SCHEME, "", s)
    scheme, rest = s.split("://", 1)
    if scheme == LOCAL_SCHEME:
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest.startswith("/"):
            raise ValueError(f"storage url {s!r}: file:// urls must be absolute (file:///abs/dir)")
        return StorageUrl(LOCAL_SCHEME, "", rest)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"storage url {s!r} names no bucket; expected {scheme}://bucket/prefix")
    return StorageUrl(scheme, bucket, key)


def local_path(url: str | os.PathLike[str]) -> Path | None:
    """The filesystem path a local URL names (``file://`` removed, a relative path left
    relative), or None for a remote URL (``gs://...``)."""
    parsed = split_url(url)
    return Path(parsed.key) if parsed.scheme == LOCAL_SCHEME else None
