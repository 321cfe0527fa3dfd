"""The import graph of the project's own packages and benchmarks, read from the source:

* no cycles, counting every import: at the top, inside functions (it runs as soon as the
  function does) and under `if TYPE_CHECKING:` (the modules still know each other's
  types; a knot there is a knot in the design);
* no job imports another job, and no library module imports a job: code two programs
  share lives in a module that is not an entry point (benchmarks are scripts that drive
  jobs in-process, as tests do, and may import them);
* the core (`pipeline` outside `pipeline/ops`, `tpu_jobs`, `beam_jobs`) imports nothing
  of the operations wing `pipeline.ops`;
* `tpu_jobs/`: the jobs at the top, library code in sub-packages, so every module at the
  top is a job and every JAX job is at the top.

Read with `ast`, not by importing. Each rule is a function of the graph, checked on a
planted graph first (it finds what it should) and then on the project.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "tpu_jobs", "dags", "beam_jobs", "benchmarks")
# Directories of scripts, run as `python benchmarks/X.py`: some put their own directory on
# sys.path and import a sibling by its bare name (`from demo_seeds import ...`).
SCRIPT_DIRS = ("benchmarks",)
WING = "pipeline.ops"
CORE = ("pipeline", "tpu_jobs", "beam_jobs")


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imported_names(node: ast.AST, package: str, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            up = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*up, base] if base else up)
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    return []


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node except the bodies of `if TYPE_CHECKING:` (imports that never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def import_graph(root: Path = ROOT, *, type_checking: bool = True) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body; with `type_checking`
    false, without the imports under `if TYPE_CHECKING:` (what runs)."""
    nodes = ast.walk if type_checking else _runtime_nodes
    mods = project_modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        script_dir = mod.split(".")[0] if mod.split(".")[0] in SCRIPT_DIRS else None
        for node in nodes(ast.parse(path.read_text(), str(path))):
            for t in _imported_names(node, package, mods):
                if script_dir and t.split(".")[0] not in PACKAGES:
                    t = f"{script_dir}.{t}"  # a sibling by its bare name (or not ours)
                while t and t not in mods:  # `import a.b.c` of a package's attribute
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    sys.setrecursionlimit(10_000)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _under(mod: str, prefixes: Iterable[str]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def job_imports(graph: dict[str, set[str]], jobs: set[str], *, by_jobs: bool) -> dict:
    """{importer: the jobs it imports} for the jobs (`by_jobs`) or for every other module,
    scripts (`SCRIPT_DIRS`) excepted."""
    return {
        m: sorted(graph[m] & jobs)
        for m in sorted(graph)
        if graph[m] & jobs and (m in jobs) == by_jobs and not _under(m, SCRIPT_DIRS)
    }


def core_imports_of_wing(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """{core module: the modules of the operations wing it imports}."""
    return {
        m: sorted(t for t in graph[m] if _under(t, [WING]))
        for m in sorted(graph)
        if _under(m, CORE) and not _under(m, [WING]) and any(_under(t, [WING]) for t in graph[m])
    }


def tpu_jobs_out_of_place(mods: dict[str, Path], jobs: set[str]) -> dict[str, list[str]]:
    """Library modules at the top of tpu_jobs/ and tpu_jobs jobs inside a sub-package."""
    top = {
        m
        for m, p in mods.items()
        if m.count(".") == 1 and m.startswith("tpu_jobs.") and p.name != "__init__.py"
    }
    ours = {j for j in jobs if j.startswith("tpu_jobs.")}
    return {"library at the top": sorted(top - ours), "jobs below the top": sorted(ours - top)}


def job_modules() -> set[str]:
    """Entry points: every launcher role, and the jobs started without one."""
    from pipeline.ops import launcher

    return {*launcher.JOBS.values(), launcher.CURATE_MODULE, launcher.HF_MODULE}


# ------------------------------------------------------------------ the rules, planted


def test_the_graph_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pipeline"
    (pkg / "ops").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    for name, text in {
        "pipeline/__init__.py": "",
        "pipeline/ops/__init__.py": "",
        "pipeline/a.py": "import pipeline.b\n",
        "pipeline/b.py": "def f():\n    from pipeline import c\n",
        "pipeline/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n",
        "pipeline/d.py": "from .ops import e\nfrom pipeline.c import helper\n",
        "pipeline/ops/e.py": "from ..a import x\n",
        "benchmarks/one.py": "from demo import y\nimport numpy\n",
        "benchmarks/demo.py": "",
    }.items():
        (tmp_path / name).write_text(text)
    assert import_graph(tmp_path) == {
        "pipeline": set(),
        "pipeline.ops": set(),
        "pipeline.a": {"pipeline.b"},  # top level
        "pipeline.b": {"pipeline.c"},  # inside a function
        "pipeline.c": {"pipeline.d"},  # under TYPE_CHECKING
        "pipeline.d": {"pipeline.ops.e", "pipeline.c"},  # relative; a module's attribute
        "pipeline.ops.e": {"pipeline.a"},
        "benchmarks.one": {"benchmarks.demo"},  # a script's sibling by its bare name
        "benchmarks.demo": set(),
    }
    assert import_graph(tmp_path, type_checking=False)["pipeline.c"] == set()
    # On the project: an import inside base_server().
    assert "pipeline.paramserver" in import_graph()["pipeline.run"]


def test_the_rules_find_what_they_should_on_a_planted_graph():
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(planted) == [["a", "b", "c"]]
    graph = {
        "tpu_jobs.trainer": {"tpu_jobs.learning.step"},
        "tpu_jobs.evaluator": {"tpu_jobs.trainer"},  # a job importing a job
        "tpu_jobs.learning.step": set(),
        "tpu_jobs.learning.memory": {"tpu_jobs.trainer"},  # library importing a job
        "dags.stage": {"pipeline.report_job", "pipeline.ops.launcher"},  # dags: not core
        "pipeline.report_job": {"pipeline.report"},
        "pipeline.report": set(),
        "pipeline.lineage": {"pipeline.ops.launcher"},  # the core reaching into the wing
        "pipeline.ops.launcher": {"pipeline.layout"},
        "pipeline.layout": set(),
        "benchmarks.trainer": {"tpu_jobs.trainer"},  # a script: allowed
    }
    jobs = {"tpu_jobs.trainer", "tpu_jobs.evaluator", "pipeline.report_job"}
    assert job_imports(graph, jobs, by_jobs=True) == {"tpu_jobs.evaluator": ["tpu_jobs.trainer"]}
    assert job_imports(graph, jobs, by_jobs=False) == {
        "dags.stage": ["pipeline.report_job"],
        "tpu_jobs.learning.memory": ["tpu_jobs.trainer"],
    }
    assert core_imports_of_wing(graph) == {"pipeline.lineage": ["pipeline.ops.launcher"]}
    mods = {
        "tpu_jobs": Path("tpu_jobs/__init__.py"),
        "tpu_jobs.trainer": Path("tpu_jobs/trainer.py"),
        "tpu_jobs.hf_tokenizer": Path("tpu_jobs/hf_tokenizer.py"),
        "tpu_jobs.generate": Path("tpu_jobs/generate/__init__.py"),
        "tpu_jobs.generate.vllm_job": Path("tpu_jobs/generate/vllm_job.py"),
    }
    assert tpu_jobs_out_of_place(mods, {"tpu_jobs.trainer", "tpu_jobs.generate.vllm_job"}) == {
        "library at the top": ["tpu_jobs.hf_tokenizer"],
        "jobs below the top": ["tpu_jobs.generate.vllm_job"],
    }


# ------------------------------------------------------------------ the rules, on the project


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], "import cycles (TYPE_CHECKING included):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_no_job_imports_another_job():
    graph = import_graph()
    jobs = job_modules()
    assert jobs <= set(graph), jobs - set(graph)
    assert job_imports(graph, jobs, by_jobs=True) == {}


def test_no_library_module_imports_a_job():
    # Not even a DAG: it starts a job through the launcher and reads its outputs through
    # the library (`pipeline.report` for the report's key, not the `report` job).
    assert job_imports(import_graph(), job_modules(), by_jobs=False) == {}


def test_the_core_imports_nothing_of_the_operations_wing():
    assert core_imports_of_wing(import_graph()) == {}


def test_jobs_at_the_top_of_tpu_jobs_and_library_below():
    found = tpu_jobs_out_of_place(project_modules(), job_modules())
    assert found == {"library at the top": [], "jobs below the top": []}


if __name__ == "__main__":  # python tests/test_imports.py [ROOT]: what the rules find
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    graph, jobs = import_graph(root), job_modules()
    for comp in cycles(graph):
        print("cycle:", " <-> ".join(comp))
    for comp in cycles(import_graph(root, type_checking=False)):
        print("cycle at run time:", " <-> ".join(comp))
    for label, found in (
        ("job -> job", job_imports(graph, jobs, by_jobs=True)),
        ("library -> job", job_imports(graph, jobs, by_jobs=False)),
        ("core -> ops", core_imports_of_wing(graph)),
    ):
        for m, targets in found.items():
            print(f"{label}: {m} -> {', '.join(targets)}")
