"""A small curation input with every kind of problem planted, and what the job must do
with each row (`Expected`), written independently of the job's code."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MAX_ROW_BYTES = 2048  # the e2e runs pass --max-row-bytes 2048

_VOCAB = [
    "apple",
    "river",
    "stone",
    "garden",
    "window",
    "basket",
    "pencil",
    "orange",
    "candle",
    "silver",
    "marble",
    "ladder",
    "rocket",
    "violin",
    "forest",
    "button",
    "carpet",
    "turtle",
    "meadow",
    "lantern",
    "harbor",
    "cactus",
    "pepper",
    "saddle",
    "walnut",
    "copper",
    "falcon",
    "tunnel",
    "velvet",
    "anchor",
    "blanket",
    "cherry",
    "dragon",
    "engine",
    "feather",
    "glacier",
    "hammer",
    "island",
    "jungle",
    "kettle",
    "lemon",
    "mirror",
    "needle",
    "oyster",
    "pillow",
    "quarry",
    "ribbon",
    "shovel",
    "thimble",
    "umbrella",
    "vessel",
    "wagon",
    "yogurt",
    "zipper",
    "bottle",
    "crayon",
]


def problem_text(rng: np.random.Generator, n_words: int = 30) -> str:
    """A distinct pseudo word problem: random words (pairwise Jaccard ~0.1) with numbers."""
    words = [str(rng.choice(_VOCAB)) for _ in range(n_words)]
    for i in rng.choice(n_words, 4, replace=False):
        words[i] = str(int(rng.integers(2, 999)))
    return "How many " + " ".join(words) + "?"


def change_one_word(text: str) -> str:
    words = text.split(" ")
    i = len(words) // 2
    words[i] = "zeppelin" if words[i] != "zeppelin" else "xylophone"
    return " ".join(words)


@dataclass
class Expected:
    rows_in: int = 0
    dead: dict[tuple[str, int], str] = field(default_factory=dict)  # (file, row) -> reason
    removed: dict[tuple[str, int], tuple[str, str]] = field(default_factory=dict)
    duplicate_of: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)
    eval_hits: dict[tuple[str, int], str] = field(default_factory=dict)  # -> eval set names
    kept: set[tuple[str, int]] = field(default_factory=set)

    def count(self, step: str) -> int:
        return sum(1 for s, _ in self.removed.values() if s == step)


def write_fixture(root: Path) -> Expected:
    """Write inputs under root/in and eval sets under root/eval; return the expectations."""
    rng = np.random.default_rng(1234)
    (root / "in").mkdir(parents=True)
    (root / "eval").mkdir(parents=True)
    exp = Expected()

    eval_gsm = [problem_text(rng) for _ in range(3)]
    eval_math = [problem_text(rng) for _ in range(2)]
    (root / "eval" / "gsm8k_test.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in eval_gsm)
    )
    (root / "eval" / "math_test.jsonl").write_text(
        "".join(json.dumps({"problem": q, "solution": r"\boxed{1}"}) + "\n" for q in eval_math)
    )

    # ---- a_gsm8k.jsonl: clean, duplicated, contaminated and malformed GSM8K rows
    clean = [problem_text(rng) for _ in range(12)]
    lines: list[bytes] = []
    name = str(root / "in" / "a_gsm8k.jsonl")

    def add(obj, *, kept=False, dead=None, removed=None, dup_of=None, hit=None) -> int:
        row = len(lines)
        lines.append(obj if isinstance(obj, bytes) else json.dumps(obj).encode())
        key = (name, row)
        if kept:
            exp.kept.add(key)
        if dead:
            exp.dead[key] = dead
        if removed:
            exp.removed[key] = removed
        if dup_of is not None:
            exp.duplicate_of[key] = (name, dup_of)
        if hit:
            exp.eval_hits[key] = hit
        return row

    first = [
        add({"question": q, "answer": f"Work.\n#### {i + 1},000"}, kept=True)
        for i, q in enumerate(clean)
    ]
    # Exact duplicates: same text up to case and spacing (answers may differ).
    add(
        {"question": clean[0].upper(), "answer": "#### 5"},
        removed=("exact_dedup", "exact_duplicate"),
        dup_of=first[0],
    )
    add(
        {"question": "  " + clean[1].replace(" ", "   ") + "\n", "answer": "#### 5"},
        removed=("exact_dedup", "exact_duplicate"),
        dup_of=first[1],
    )
    add(
        {"question": clean[2], "answer": "#### 7"},
        removed=("exact_dedup", "exact_duplicate"),
        dup_of=first[2],
    )
    # Near duplicates: one word changed.
    add(
        {"question": change_one_word(clean[3]), "answer": "#### 9"},
        removed=("near_dedup", "near_duplicate"),
        dup_of=first[3],
    )
    add(
        {"question": change_one_word(clean[4]), "answer": "#### 9"},
        removed=("near_dedup", "near_duplicate"),
        dup_of=first[4],
    )
    # Contaminated: an eval problem embedded in a longer text.
    add(
        {"question": "Consider this. " + eval_gsm[0] + " Explain.", "answer": "#### 2"},
        removed=("decontaminate", "contaminated"),
        hit="gsm8k_test",
    )
    add(
        {"question": problem_text(rng, 8) + " " + eval_math[1], "answer": "#### 2"},
        removed=("decontaminate", "contaminated"),
        hit="math_test",
    )
    # Malformed rows, one of every kind.
    add(b"{not json", dead="invalid_json")
    add(b"[1, 2, 3]", dead="invalid_json")
    add(b'{"question": "caf\xe9 problem", "answer": "#### 1"}', dead="invalid_utf8")
    add(b'{"question": "lone \\ud800 surrogate", "answer": "#### 1"}', dead="invalid_utf8")
    add(b"[" * 2000, dead="invalid_json")  # nested past the parser's recursion limit
    add({"question": "x" * (MAX_ROW_BYTES + 100), "answer": "#### 1"}, dead="oversized")
    add({"question": problem_text(rng)}, dead="missing_field")
    add({"question": "   ", "answer": "#### 1"}, dead="missing_field")
    add({"question": ["a", "list"], "answer": "#### 1"}, dead="invalid_field")
    add({"question": problem_text(rng), "answer": "The answer is 4."}, dead="no_answer")
    add({"prompt_text": "what?", "label": 3}, dead="unknown_schema")
    (root / "in" / "a_gsm8k.jsonl").write_bytes(b"\n".join(lines) + b"\n\n")  # blank line: no row

    # ---- b_math.parquet: MATH rows, binary columns so one row can hold invalid UTF-8
    mname = str(root / "in" / "b_math.parquet")
    math_problems = [problem_text(rng).encode() for _ in range(4)] + [b"bad \xff bytes", b"ok?"]
    solutions = [rb"so $\boxed{\frac{1}{%d}}$" % (i + 2) for i in range(5)] + [
        rb"\boxed{\frac{1}{2}"
    ]
    pq.write_table(
        pa.table(
            {
                "problem": pa.array(math_problems, pa.binary()),
                "solution": pa.array(solutions, pa.binary()),
                "level": [f"Level {i}" for i in range(6)],
            }
        ),
        mname,
    )
    for i in range(4):
        exp.kept.add((mname, i))
    exp.dead[(mname, 4)] = "invalid_utf8"
    exp.dead[(mname, 5)] = "no_answer"

    # ---- c_rlax.csv: this project's own Problem rows
    cname = str(root / "in" / "c_rlax.csv")
    csv_rows = ["problem_id,task,prompt,answer,meta"]
    for i in range(4):
        csv_rows.append(f'rx{i},countdown,"{problem_text(rng, 12)}",{i},"{{""target"": {i}}}"')
        exp.kept.add((cname, i))
    csv_rows.append(f'rx0,countdown,"{problem_text(rng, 12)}",5,')  # id of row 0, other text
    exp.removed[(cname, 4)] = ("exact_dedup", "duplicate_problem_id")
    exp.duplicate_of[(cname, 4)] = (cname, 0)
    csv_rows.append("rx9,countdown,too few fields")
    exp.dead[(cname, 5)] = "invalid_row"
    csv_rows.append(f'rx8,countdown,"{problem_text(rng, 12)}",1,"{{not json"')
    exp.dead[(cname, 6)] = "invalid_field"
    (root / "in" / "c_rlax.csv").write_text("\n".join(csv_rows) + "\n")

    # ---- d_broken.parquet: not Parquet at all
    dname = str(root / "in" / "d_broken.parquet")
    (root / "in" / "d_broken.parquet").write_bytes(b"PAR1 this is not a parquet file")
    exp.dead[(dname, 0)] = "unreadable_file"

    exp.rows_in = len(lines) + 6 + 7 + 1
    return exp
