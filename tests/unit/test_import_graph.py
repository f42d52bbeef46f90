"""Imports flow one way: no kvcached_core module imports, even from inside a function, a module
that imports it back (a circle works only while its import order holds, and hides which module
owns a fact)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvcached_core"


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """kvcached_core module -> the kvcached_core modules it imports anywhere in its source
    (a submodule importing its own package is not an edge: that is how packages load)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m.split(".")[0] == "kvcached_core"
                       and m != name and not name.startswith(m + ".")}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of the graph, as the modules along it, or [] when it has none."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        for target in sorted(graph.get(module, ())):
            circle = visit(target, [*path, module])
            if circle:
                return circle
        done.add(module)
        return []

    for module in sorted(graph):
        circle = visit(module, [])
        if circle:
            return circle
    return []


def test_the_runtime_imports_flow_one_way() -> None:
    circle = find_circle(import_graph())
    assert not circle, " -> ".join(circle)


def test_a_circle_through_a_function_level_import_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_circle(graph) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) == []
