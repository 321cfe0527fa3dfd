"""The job reading from and writing to gs:// on the GCS emulator (fake-gcs-server).

Beam's own GCS sink finalises files with the JSON batch API, which fake-gcs-server lacks;
the job stages locally and publishes through the project's ObjectStore instead, so this
is the same code path as on real GCS.
"""

from __future__ import annotations

import hashlib
import json
import uuid

from beam_jobs import curate
from pipeline.parquet_bytes import table_from_bytes
from pipeline.storage import open_store
from tests.beam_jobs.fixtures import MAX_ROW_BYTES, write_fixture


def test_gs_inputs_and_output(gcs_emulator, tmp_path):
    exp = write_fixture(tmp_path)
    base = f"gs://{gcs_emulator.bucket}/curate-{uuid.uuid4().hex[:8]}"
    inputs = open_store(f"{base}/in")
    for f in sorted((tmp_path / "in").iterdir()):
        inputs.write_new_file(f.name, f)
    out = f"{base}/out"
    argv = [
        "--input",
        f"{base}/in/*.jsonl",
        "--input",
        f"{base}/in/*.parquet",
        "--input",
        f"{base}/in/*.csv",
        "--eval-sets",
        str(tmp_path / "eval" / "*.jsonl"),
        "--output",
        out,
        "--max-row-bytes",
        str(MAX_ROW_BYTES),
    ]
    stats = curate.run(curate.parse_args(argv))

    steps = {s["step"]: s for s in stats["steps"]}
    assert stats["rows_in"] == exp.rows_in
    assert sum(steps["parse"]["removed"].values()) == len(exp.dead)
    assert steps["exact_dedup"]["removed"] == {"exact_duplicate": 3, "duplicate_problem_id": 1}
    assert steps["near_dedup"]["removed"] == {"near_duplicate": 2}
    assert steps["decontaminate"]["removed"] == {"contaminated": 2}

    store = open_store(out)
    manifest = json.loads(store.read("_SUCCESS"))
    assert sorted(manifest["files"]) == sorted(k for k in store.list("") if k != "_SUCCESS")
    for key, meta in manifest["files"].items():
        assert hashlib.sha256(store.read(key)).hexdigest() == meta["sha256"]
    dead = table_from_bytes(store.read("dead_letter/part-00000-of-00001.parquet"))
    sources = {s.replace(f"{base}/in/", "") for s in dead.column("source").to_pylist()}
    assert sources == {"a_gsm8k.jsonl", "b_math.parquet", "c_rlax.csv", "d_broken.parquet"}

    # A second run finds _SUCCESS with the same fingerprint and writes nothing.
    before = {k: store.read(k) for k in store.list("")}
    assert curate.run(curate.parse_args(argv)) == stats
    assert {k: store.read(k) for k in store.list("")} == before
