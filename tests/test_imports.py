"""No import circles inside ddtree: every import counts, those inside functions too (an import
moved into a function to dodge a circle is still one)."""

from __future__ import annotations

import ast
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import ddtree

ROOT = Path(ddtree.__file__).resolve().parent


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports. ``from pkg import name`` is an edge
    to ``pkg.name`` when that is a module, else to ``pkg``; compiled extensions are leaves."""
    base = package.parent
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(base).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                parent = here[: len(here) - node.level + 1] if node.level else []
                mod = ".".join(parent + ([node.module] if node.module else []))
                targets = [
                    f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod
                    for a in node.names
                    if not _is_extension(base / mod.replace(".", "/"), a.name)
                ]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _is_extension(folder: Path, name: str) -> bool:
    """A compiled module ``name`` in ``folder``: built, or its C++ source (before a build)."""
    return any((folder / f"{name}{s}").exists() for s in [*EXTENSION_SUFFIXES, ".cpp"])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_ddtree_has_no_import_circle():
    graph = import_graph(ROOT)
    assert len(graph) > 50 and graph["ddtree.engine.loop"]  # it read the package
    assert cycles(graph) == []


def test_the_check_finds_a_circle_through_a_function_local_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import a\n")
    (pkg / "sub" / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.a import x\n")
    (pkg / "leaf.py").write_text("import pkg.b\n")
    assert cycles(import_graph(pkg)) == [["pkg.b", "pkg.sub.a"]]
