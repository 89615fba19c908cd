"""No import circle in the daemons (kvstore/), the client (client/kvstore_client/) or the
benches (bench/kvstore_bench/), within a package or across them (type-only and
function-level imports count too): the layers of DESIGN.md hold, e.g. worker.store
imports worker.session_ops, never the reverse, and the client never imports the daemons."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "kvstore", ROOT / "client" / "kvstore_client", ROOT / "bench" / "kvstore_bench")


def module_files(packages: tuple[Path, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of ``packages``."""
    files = {}
    for package in packages:
        for path in package.rglob("*.py"):
            parts = list(path.relative_to(package.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def import_graph(packages: tuple[Path, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (at any level of its code; an
    import of a package counts as one of its ``__init__``)."""
    files = module_files(packages)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for alias in node.names:
                    for name in (f"{base}.{alias.name}", base):
                        if name in files and name != mod:
                            graph[mod].add(name)
                            break
            elif isinstance(node, ast.Import):
                graph[mod].update(a.name for a in node.names if a.name in files and a.name != mod)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_finder_sees_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_graph_sees_type_only_and_cross_package_imports() -> None:
    graph = import_graph()
    assert "kvstore_client.errors" in graph["kvstore.worker.store"]
    assert "kvstore.worker.store" in graph["kvstore.worker.servicer"]


def test_no_import_circle_in_the_daemons_the_client_or_the_benches() -> None:
    assert circles(import_graph()) == []


def test_the_client_never_imports_the_daemons_or_the_benches() -> None:
    graph = import_graph()
    leaks = sorted(
        (m, d)
        for m, deps in graph.items()
        if m.startswith("kvstore_client")
        for d in deps
        if not d.startswith("kvstore_client")
    )
    assert leaks == []
