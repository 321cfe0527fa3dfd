"""Source schemas (GSM8K, MATH, HumanEval, MBPP, APPS, this project's Problem rows) and
their alignment to the project's problem schema.

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
from pipeline.tasks.base import Problem
from pipeline.tasks.base import problem_id as make_problem_id
from pipeline.tasks.code_task import check_code_problem, function_problem

# Rejection reasons produced here (reader-level ones live in beam_jobs.sources).
UNKNOWN_SCHEMA = "unknown_schema"
MISSING_FIELD = "missing_field"
INVALID_FIELD = "invalid_field"
NO_ANSWER = "no_answer"
NO_TESTS = "no_tests"


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


def _code(fields: Mapping[str, Any], name: str) -> str | Rejected:
    """A required code field, kept as written (indentation is syntax): only CRLF -> LF."""
    value = fields.get(name)
    if value is None:
        return Rejected(MISSING_FIELD, f"field {name!r} is missing")
    if not isinstance(value, str):
        return Rejected(INVALID_FIELD, f"field {name!r} is a {type(value).__name__}, not text")
    if not value.strip():
        return Rejected(MISSING_FIELD, f"field {name!r} is empty")
    return value.replace("\r\n", "\n")


def _curated(
    task: str,
    problem: str,
    answer: str,
    meta: dict[str, Any],
    schema: str,
    statement: str | None = None,
) -> Curated:
    """`statement` is what the prompt shows when it must keep its layout (code); the
    normalised `problem` is what dedup, decontamination and the id see."""
    return Curated(
        problem_id=make_problem_id(task, problem),
        task=task,
        problem=problem,
        prompt=prompts.render(task, problem if statement is None else statement),
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


def _code_problem(
    problem: str, statement: str, answer: str, meta: dict[str, Any], schema: str
) -> Curated | Rejected:
    """A `code` problem, refused (NO_TESTS) unless the family's verifier can score it."""
    curated = _curated("code", normalize_text(problem), answer, meta, schema, statement)
    try:
        check_code_problem(Problem(curated.problem_id, "code", curated.prompt, answer, meta))
    except ValueError as err:
        return Rejected(NO_TESTS, str(err))
    return curated


def align_humaneval(fields: Mapping[str, Any]) -> Curated | Rejected:
    """HumanEval rows: the prompt is the function stub; the answer the full program."""
    values = {}
    for name in ("prompt", "canonical_solution", "test", "entry_point"):
        value = _code(fields, name)
        if isinstance(value, Rejected):
            return value
        values[name] = value
    stub = values["prompt"]
    meta = {
        "tests": values["test"],
        "entry_point": values["entry_point"].strip(),
        "prefix": stub,  # so that a continuation of the stub is scored (code_task)
        **_extras(fields, ("prompt", "canonical_solution", "test", "entry_point")),
    }
    statement = function_problem(stub)
    return _code_problem(stub, statement, stub + values["canonical_solution"], meta, "humaneval")


def _text_list(fields: Mapping[str, Any], name: str) -> list[str] | Rejected:
    """A list of code lines/asserts: a list of strings, or JSON text of one (CSV)."""
    value = fields.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip().startswith("[") else [value]
        except ValueError:
            return Rejected(INVALID_FIELD, f"field {name!r} is text but not a JSON list")
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        return Rejected(INVALID_FIELD, f"field {name!r} must be a list of strings")
    return [v.replace("\r\n", "\n") for v in value if v.strip()]


def align_mbpp(fields: Mapping[str, Any]) -> Curated | Rejected:
    """MBPP rows (full: `text`; sanitized: `prompt`): the asserts are the tests, after
    `test_setup_code` and the sanitized split's `test_imports`; the prompt shows the
    asserts, as MBPP's own prompt does (they name the function to write)."""
    text = _text(fields, "text" if "text" in fields else "prompt")
    if isinstance(text, Rejected):
        return text
    code = _code(fields, "code")
    if isinstance(code, Rejected):
        return code
    asserts = _text_list(fields, "test_list")
    if isinstance(asserts, Rejected):
        return asserts
    if not asserts:
        return Rejected(NO_TESTS, "field 'test_list' has no asserts")
    imports = _text_list(fields, "test_imports")
    if isinstance(imports, Rejected):
        return imports
    setup = fields.get("test_setup_code") or ""
    if not isinstance(setup, str):
        return Rejected(INVALID_FIELD, "field 'test_setup_code' must be text")
    tests = "\n".join([*imports, *([setup] if setup.strip() else []), *asserts]) + "\n"
    problem = f"{text}\nYour code should pass these tests:\n" + "\n".join(asserts)
    used = ("text", "prompt", "code", "test_list", "test_setup_code", "test_imports")
    meta = {"tests": tests, **_extras(fields, used)}
    return _code_problem(problem, problem, code, meta, "mbpp")


def _json_field(fields: Mapping[str, Any], name: str) -> Any:
    value = fields.get(name)
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except ValueError:
            return Rejected(INVALID_FIELD, f"field {name!r} is text but not JSON")
    return value


def _io_text(value: Any) -> str | None:
    """One APPS input or output: text, or a list of lines (some outputs are)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return None


def align_apps(fields: Mapping[str, Any]) -> Curated | Rejected:
    """APPS rows: stdin/stdout cases from `input_output`; the first of `solutions`, when
    there is one, is the reference answer. Call-based problems (`fn_name`, LeetCode
    style) are refused: their inputs are argument lists, not stdin."""
    question = _text(fields, "question")
    if isinstance(question, Rejected):
        return question
    io = _json_field(fields, "input_output")
    if isinstance(io, Rejected):
        return io
    if not io:
        return Rejected(NO_TESTS, "field 'input_output' is missing or empty")
    if not isinstance(io, dict):
        return Rejected(INVALID_FIELD, "field 'input_output' must be an object {inputs, outputs}")
    if io.get("fn_name"):
        return Rejected(
            NO_TESTS,
            f"call-based problem (fn_name {io['fn_name']!r}); only stdin/stdout problems "
            "are supported",
        )
    inputs, outputs = io.get("inputs") or [], io.get("outputs") or []
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        return Rejected(INVALID_FIELD, "input_output 'inputs' and 'outputs' must be lists")
    if len(inputs) != len(outputs):
        return Rejected(
            INVALID_FIELD, f"input_output has {len(inputs)} inputs but {len(outputs)} outputs"
        )
    cases = [
        {"stdin": _io_text(i), "stdout": _io_text(o)} for i, o in zip(inputs, outputs, strict=True)
    ]
    if any(c["stdin"] is None or c["stdout"] is None for c in cases):
        return Rejected(INVALID_FIELD, "input_output cases must be text (or lists of lines)")
    solutions = _json_field(fields, "solutions")
    if isinstance(solutions, Rejected):
        return solutions
    if not isinstance(solutions, list):
        solutions = []
    answer = next((s for s in solutions if isinstance(s, str) and s.strip()), "")
    meta = {"io": cases, **_extras(fields, ("question", "input_output", "solutions"))}
    return _code_problem(question, question, answer.replace("\r\n", "\n"), meta, "apps")


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
        SourceSchema(
            "humaneval",
            ("task_id", "prompt", "canonical_solution", "test", "entry_point"),
            align_humaneval,
        ),
        SourceSchema("mbpp", ("code", "test_list"), align_mbpp),
        SourceSchema("apps", ("question", "input_output"), align_apps),
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
