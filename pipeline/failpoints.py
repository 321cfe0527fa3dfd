"""Named crash points, so tests can SIGKILL a process at an exact moment.

`RLAX_FAILPOINTS="trainer.checkpoint_started@4,rollout.before_commit@1"` makes the
process kill itself (SIGKILL: no cleanup, no flush) when it reaches that point with that
index. Unset in normal runs, where `hit` costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator

ENV = "RLAX_FAILPOINTS"

# Every failpoint: where it kills, and what the kill leaves behind for the next process.
POINTS = {
    "trainer.checkpoint_started": "the trainer, a checkpoint's write begun (a torn checkpoint)",
    "rollout.before_commit": "a worker, its batch made but not committed (a held lease)",
    "teacher.before_publish": "pin_teacher, the teacher's config copied, not its weights",
    "teacher.before_pin": "pin_teacher, the teacher copy committed, not pinned",
}


def _items(spec: str) -> Iterator[tuple[str, str, str]]:
    """(item, name, index or "") of each comma-separated `name[@index]` of `spec`."""
    for item in filter(None, (i.strip() for i in spec.split(","))):
        point, _, at = item.partition("@")
        yield item, point, at


def check_spec(spec: str) -> None:
    """Raise ValueError unless `spec` is a valid RLAX_FAILPOINTS value: comma-separated
    `name` or `name@index` items, each name in POINTS."""
    for item, point, at in _items(spec):
        if point not in POINTS or (at and not at.isdigit()):
            raise ValueError(
                f"failpoint {item!r} is invalid; allowed: NAME or NAME@INDEX, NAME one of "
                + ", ".join(POINTS)
            )


def armed(name: str, index: int | None = None) -> bool:
    for _, point, at in _items(os.environ.get(ENV, "")):
        if point == name and (not at or index is None or int(at) == index):
            return True
    return False


def hit(name: str, index: int | None = None, before: Callable[[], None] | None = None) -> None:
    """SIGKILL this process if the failpoint `name` (at `index`) is armed."""
    if armed(name, index):
        if before is not None:
            before()
        print(f"[failpoint] {name}@{index}: SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
