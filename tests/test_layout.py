"""The tree is the architecture: no module of ``mla`` imports one that imports it back.

Every import counts, at module level or inside a function (a lazy import is still a circle a
reader must untangle); importing a module's own enclosing package does not (Python runs it
first anyway).
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of mla: its dotted name -> (file, is a package)."""
    out = {}
    for path in (SRC / "mla").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph = {name: set() for name in mods}
    for name, (path, package) in mods.items():
        here = name if package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here.split(".")[:len(here.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:   # `from pkg import module` imports the module
                    graph[name].add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in mods else target)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names)
        graph[name] = {t for t in graph[name] if t in mods and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert "mla.hf.engine" in graph and "mla.hf.patch" in graph["mla.hf.engine"]
    assert cycles(graph) == []


def test_the_transformers_integration_is_one_package():
    flat = sorted(p.name for p in (SRC / "mla").glob("*.py") if p.stem.startswith(("hf", "serve")))
    assert flat == [], f"expected the integration under src/mla/hf/, found {flat}"
