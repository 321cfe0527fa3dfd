"""The abort marker: how the RL stage of a run gives up as a whole.

The trainer and the rollout workers run side by side (separate tasks, pods or processes)
and wait on each other through the run's store. When one of them fails for good (its last
retry failed), it writes this create-only marker, and the others, which poll it, stop
instead of waiting forever for a partner that is gone. A new round (the tasks cleared or
the run re-triggered) deletes a stale marker before it starts.
"""

from __future__ import annotations

import contextlib
import json
import time

from pipeline.layout import ABORT_KEY
from pipeline.storage import ObjectNotFound, ObjectStore


def read_abort(store: ObjectStore) -> str | None:
    """The reason the run was aborted, or None."""
    try:
        return json.loads(store.read(ABORT_KEY)).get("reason", "aborted")
    except ObjectNotFound:
        return None


def write_abort(store: ObjectStore, reason: str) -> None:
    store.write_new(ABORT_KEY, json.dumps({"reason": reason, "time": time.time()}).encode())


def clear_stale_abort(store: ObjectStore) -> None:
    with contextlib.suppress(ObjectNotFound):
        store.delete(ABORT_KEY)
