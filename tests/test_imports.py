"""The import graph of ako's modules stays acyclic (docs/design.md, "Layout": imports point down)."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).parent.parent / "src"


def module_graph() -> dict[str, set[str]]:
    """Each ako module's name -> the ako modules it imports, at any depth of its code (an import
    inside a function counts: it closes a circle as surely as one at the top)."""
    files = {}
    for path in (SOURCE / "ako").rglob("*.py"):
        name = ".".join(path.relative_to(SOURCE).with_suffix("").parts).removesuffix(".__init__")
        files[name] = path
    graph = {}
    for name, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in imported if m in files and m != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target, path)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [])):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = module_graph()
    assert "ako.experiments.cell_process" in graph and "ako.cli" in graph["ako.__main__"]
    found = cycle(graph)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
