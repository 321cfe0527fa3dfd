"""The import graph of the project's own packages: no cycles (lazy imports inside
functions included), and no job imports another job (shared code lives in modules that
are not entry points).

Read from the source with `ast`, not by importing: an import inside a function counts as
much as one at the top, because it runs as soon as that function does.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "tpu_jobs", "dags", "beam_jobs")


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body."""
    mods = project_modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            for t in targets:
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


def job_modules() -> set[str]:
    """Entry points: every launcher role, and the jobs started without one."""
    from pipeline.ops import launcher

    return {*launcher.JOBS.values(), launcher.CURATE_MODULE, launcher.HF_MODULE}


def test_the_graph_sees_top_level_and_lazy_imports():
    graph = import_graph()
    assert "pipeline.storage" in graph["pipeline.run"]  # top level
    assert "pipeline.paramserver" in graph["pipeline.run"]  # inside base_server()
    assert "pipeline.config" not in graph["pipeline.tasks.base"]  # only under TYPE_CHECKING
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(planted) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_job_imports_another_job():
    graph = import_graph()
    jobs = job_modules()
    assert jobs <= set(graph), jobs - set(graph)
    crossing = {j: sorted(graph[j] & jobs) for j in sorted(jobs) if graph[j] & jobs}
    assert crossing == {}


if __name__ == "__main__":  # python tests/test_imports.py [ROOT]: cycles of a tree
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for comp in cycles(import_graph(root)):
        print(" <-> ".join(comp))
