"""Prompt templates of the curated task families (GSM8K, MATH).

The generated families in `pipeline.tasks` build their own prompts; these follow the
same convention: the completion is free text ending with `ANSWER_MARKER` and the answer
(see `pipeline.tasks.base.final_answer`). A family without a template keeps its text.
"""

from __future__ import annotations

from pipeline.tasks.base import ANSWER_MARKER

TEMPLATES: dict[str, str] = {
    "gsm8k": "{problem}\nEnd with {marker} and the final answer.",
    "math": "{problem}\nEnd with {marker} and the final answer.",
}


def render(task: str, problem: str) -> str:
    template = TEMPLATES.get(task, "{problem}")
    return template.format(problem=problem, marker=ANSWER_MARKER)
