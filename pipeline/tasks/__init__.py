"""Registry of verifiable task families: `TASKS[name]` is a `Task` instance.

Kept light (pure Python + NumPy): `TaskConfig` validates family names against it.
"""

from __future__ import annotations

from pipeline.tasks.arithmetic import ArithmeticTask
from pipeline.tasks.base import Problem, Task
from pipeline.tasks.code_task import CodeTask
from pipeline.tasks.countdown import CountdownTask
from pipeline.tasks.long_multiplication import LongMultiplicationTask
from pipeline.tasks.math_task import MathTask

TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        ArithmeticTask(),
        CountdownTask(),
        CodeTask(),
        MathTask(),
        LongMultiplicationTask(),
    )
}


class UnknownTaskError(KeyError):
    """No task family of that name is registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def get_task(name: str) -> Task:
    """The task family called `name`; raises UnknownTaskError listing the known names."""
    try:
        return TASKS[name]
    except KeyError:
        raise UnknownTaskError(
            f"task family {name!r} is unknown; known families: {', '.join(sorted(TASKS))}"
        ) from None


__all__ = ["TASKS", "Problem", "Task", "UnknownTaskError", "get_task"]
