"""DAG files parse fast and import nothing heavy (no jax/flax/beam/torch/tpu_jobs).

Measured like the DAG processor does it: a process that has Airflow imported forks one
child per file, and the child parses (imports) the file."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.dags.conftest import DAGS, ROOT

HEAVY = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax",
    "apache_beam",
    "torch",
    "transformers",
    "tensorflow",
    "tpu_jobs",
    "beam_jobs",
    "matplotlib",
    "pyarrow",
)

PROBE = r"""
import json, os, runpy, sys, time
import airflow.sdk  # already imported in the DAG processor
files, heavy = json.loads(sys.argv[1]), tuple(json.loads(sys.argv[2]))
for path in files:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        t0 = time.perf_counter()
        ns = runpy.run_path(path, run_name="dag_probe")
        took = time.perf_counter() - t0
        from airflow.sdk import DAG
        dags = [v.dag_id for v in ns.values() if isinstance(v, DAG)]
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
        os.write(w, json.dumps({"file": path, "seconds": took, "heavy": loaded, "dags": dags}).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.waitpid(pid, 0)
    print(data.decode())
"""


def test_dag_files_parse_under_2s_without_heavy_imports():
    # report_plugin.py is the API server's (an Airflow plugin), never parsed for DAGs.
    skip = ("__init__.py", "report_plugin.py")
    files = sorted(str(p) for p in DAGS.glob("*.py") if p.name not in skip)
    dag_files = [f for f in files if not f.endswith(("params.py", "stage.py"))]
    assert len(dag_files) == 3
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(files), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(files)
    for r in results:
        assert r["heavy"] == [], f"{r['file']} imports {r['heavy']}"
        assert r["seconds"] < 2.0, f"{r['file']} took {r['seconds']:.2f}s to parse"
    by_file = {r["file"].rsplit("/", 1)[-1]: r["dags"] for r in results}
    assert by_file["rl_training.py"] == ["rlax_rl_training"]
    assert by_file["curation.py"] == ["rlax_curation"]
    assert by_file["retraining.py"] == ["rlax_retraining"]


def test_helper_modules_are_ignored_by_the_dag_processor():
    ignored = (DAGS / ".airflowignore").read_text().split()
    assert {"params.py", "stage.py", "report_plugin.py"} <= set(ignored)
