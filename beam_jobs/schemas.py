"""Source schemas (GSM8K, MATH, this project's Problem rows) and their alignment to the
project's problem schema.

`align(raw_fields, schema)` turns one decoded source row into a `Curated` problem or a
`Rejected` (reason, detail). It never raises on bad data. Schemas are a registry, so a
new source format is one entry in `SCHEMAS`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from beam_jobs import prompts
from beam_jobs.text import normalize_text
from pipeline.tasks.answers import extract_gsm8k, extract_math
from pipeline.tasks.base import problem_id as make_problem_id

# Rejection reasons produced here (reader-level ones live in beam_jobs.sources).
UNKNOWN_SCHEMA = "unknown_schema"
MISSING_FIELD = "missing_field"
INVALID_FIELD = "invalid_field"
NO_ANSWER = "no_answer"


@dataclass(frozen=True)
class Curated:
    """A source row aligned to the Problem fields, plus what curation needs."""

    problem_id: str
    task: str
    problem: str  # normalised problem text: dedup, decontamination and ids use this
    prompt: str  # the problem rendered with the task's prompt template
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
    schema: str = ""


@dataclass(frozen=True)
class Rejected:
    reason: str
    detail: str


def _text(fields: Mapping[str, Any], name: str) -> str | Rejected:
    """A required text field: present, a string (numbers allowed), non-empty once normalised."""
    value = fields.get(name)
    if value is None:
        return Rejected(MISSING_FIELD, f"field {name!r} is missing")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return Rejected(INVALID_FIELD, f"field {name!r} is a {type(value).__name__}, not text")
    text = normalize_text(str(value))
    if not text:
        return Rejected(MISSING_FIELD, f"field {name!r} is empty")
    return text


def _extras(fields: Mapping[str, Any], used: tuple[str, ...]) -> dict[str, Any]:
    """Scalar source fields we do not map (MATH's level/type, ids...) kept in meta."""
    return {
        k: v
        for k, v in sorted(fields.items())
        if k not in used
        and isinstance(k, str)
        and (v is None or isinstance(v, str | int | float | bool))
    }


def _curated(task: str, problem: str, answer: str, meta: dict[str, Any], schema: str) -> Curated:
    return Curated(
        problem_id=make_problem_id(task, problem),
        task=task,
        problem=problem,
        prompt=prompts.render(task, problem),
        answer=answer,
        meta=meta,
        schema=schema,
    )


def align_gsm8k(fields: Mapping[str, Any]) -> Curated | Rejected:
    question = _text(fields, "question")
    if isinstance(question, Rejected):
        return question
    solution = _text(fields, "answer")
    if isinstance(solution, Rejected):
        return solution
    answer = extract_gsm8k(solution)
    if answer is None:
        return Rejected(NO_ANSWER, "field 'answer' has no '#### <answer>' line")
    meta = {"solution": solution, **_extras(fields, ("question", "answer"))}
    return _curated("math", question, answer, meta, "gsm8k")


def align_math(fields: Mapping[str, Any]) -> Curated | Rejected:
    problem = _text(fields, "problem")
    if isinstance(problem, Rejected):
        return problem
    solution = _text(fields, "solution")
    if isinstance(solution, Rejected):
        return solution
    answer = extract_math(solution)
    if answer is None and fields.get("answer") not in (None, ""):
        # Some MATH derivatives ship the final answer in its own column.
        given = _text(fields, "answer")
        answer = None if isinstance(given, Rejected) else extract_math(f"\\boxed{{{given}}}")
    if answer is None:
        return Rejected(NO_ANSWER, "field 'solution' has no complete \\boxed{...}")
    meta = {"solution": solution, **_extras(fields, ("problem", "solution", "answer"))}
    return _curated("math", problem, answer, meta, "math")


def align_rlax(fields: Mapping[str, Any]) -> Curated | Rejected:
    """This project's own Problem rows: ids, tasks and prompts are kept as they are."""
    values = {}
    for name in ("problem_id", "task", "prompt", "answer"):
        value = _text(fields, name)
        if isinstance(value, Rejected):
            return value
        values[name] = value
    meta = fields.get("meta")
    if isinstance(meta, str):
        try:
            meta = json.loads(meta) if meta.strip() else {}
        except ValueError:
            return Rejected(INVALID_FIELD, "field 'meta' is text but not JSON")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        return Rejected(INVALID_FIELD, f"field 'meta' is a {type(meta).__name__}, not an object")
    # The raw prompt: rendering is the task's business and already happened upstream.
    return Curated(
        problem_id=str(fields["problem_id"]).strip(),
        task=values["task"],
        problem=values["prompt"],
        prompt=values["prompt"],
        answer=values["answer"],
        meta=meta,
        schema="rlax",
    )


@dataclass(frozen=True)
class SourceSchema:
    name: str
    required: tuple[str, ...]
    align: Callable[[Mapping[str, Any]], Curated | Rejected]


SCHEMAS: dict[str, SourceSchema] = {
    s.name: s
    for s in (
        SourceSchema("rlax", ("problem_id", "task", "prompt", "answer"), align_rlax),
        SourceSchema("gsm8k", ("question", "answer"), align_gsm8k),
        SourceSchema("math", ("problem", "solution"), align_math),
    )
}


def detect_schema(fields: Mapping[str, Any]) -> SourceSchema | None:
    """The schema whose required fields the row has most of (ties: larger share, then
    registry order); None when the row has none of any schema's fields."""
    best, best_key = None, (0, 0.0)
    for schema in SCHEMAS.values():
        present = sum(1 for name in schema.required if name in fields)
        key = (present, present / len(schema.required))
        if present and key > best_key:
            best, best_key = schema, key
    return best


def align(fields: Mapping[str, Any], schema: str = "auto") -> Curated | Rejected:
    if schema == "auto":
        found = detect_schema(fields)
        if found is None:
            keys = ", ".join(sorted(map(str, fields))) or "none"
            allowed = "; ".join(f"{s.name}: {', '.join(s.required)}" for s in SCHEMAS.values())
            return Rejected(UNKNOWN_SCHEMA, f"fields ({keys}) match no schema ({allowed})")
        return found.align(fields)
    if schema not in SCHEMAS:
        raise ValueError(f"--schema {schema!r} is invalid; allowed: auto, {', '.join(SCHEMAS)}")
    return SCHEMAS[schema].align(fields)
