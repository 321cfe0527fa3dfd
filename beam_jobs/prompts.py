"""Prompt templates of the curated task families, by family.

The generated families in `pipeline.tasks` build their own prompts. The math family
(GSM8K and MATH rows) asks for the final answer in `\\boxed{}`, the convention of
Qwen2.5-Math, DeepSeek-R1 and most math RL recipes: it is what the verifier reads first
(`pipeline.tasks.math_task`). The code family (HumanEval, MBPP, APPS rows) asks for the
program in a ```python block, the template the code verifier and its HumanEval loader
share (`pipeline.tasks.code_task.PROMPT_TEMPLATE`). A family without a template keeps its
text.
"""

from __future__ import annotations

from pipeline.tasks.code_task import PROMPT_TEMPLATE as CODE_TEMPLATE

TEMPLATES: dict[str, str] = {
    "math": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "code": CODE_TEMPLATE,
}


def render(task: str, problem: str) -> str:
    template = TEMPLATES.get(task, "{problem}")
    return template.format(problem=problem)
