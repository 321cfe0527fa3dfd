"""Object storage used as the parameter server between the trainer and the rollout fleet.

One small interface, ``ObjectStore`` (``base``), with backends picked by URL scheme from one
table (``registry.BACKENDS``):

* ``LocalStore`` (``local``): a directory; local paths and ``file:///abs/dir``.
* ``GCSStore`` (``gcs``): ``gs://bucket/prefix``; create-only and CAS on object generations.
* ``MemoryStore`` (``memory``): ``memory://name/prefix``, held in this process.

``RetryPolicy``, ``call_with_retry`` and ``RetryingStore`` (the retry layer for any store)
live in ``retry``; ``FlakyStore`` (fault injection) in ``faults``. URLs are parsed only by
``urls`` (``split_url``, ``local_path``); ``glob`` matches local or remote patterns.

``google.cloud.storage`` is imported lazily: importing this package stays cheap.
"""

from pipeline.storage.base import (
    RESERVED_PREFIX,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    TransientStorageError,
    safe_name,
    validate_key,
)
from pipeline.storage.faults import FlakyStore
from pipeline.storage.gcs import GCSStore
from pipeline.storage.local import LocalStore
from pipeline.storage.memory import MemoryStore
from pipeline.storage.registry import BACKENDS, Match, glob, open_parent, open_store
from pipeline.storage.retry import RetryingStore, RetryPolicy, call_with_retry
from pipeline.storage.urls import StorageUrl, StorageUrlError, local_path, split_url

__all__ = [
    "BACKENDS",
    "GCSStore",
    "FlakyStore",
    "LocalStore",
    "Match",
    "MemoryStore",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "RESERVED_PREFIX",
    "RetryPolicy",
    "RetryingStore",
    "StorageError",
    "StorageUrl",
    "StorageUrlError",
    "TransientStorageError",
    "call_with_retry",
    "glob",
    "local_path",
    "open_parent",
    "open_store",
    "safe_name",
    "split_url",
    "validate_key",
]
