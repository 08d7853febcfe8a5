"""No import cycle among the runtime's modules: each module's imports (module-level, inside
functions and under ``TYPE_CHECKING`` alike: a lazy import only hides a cycle) are read from its
source with ``ast``, and the graph of the packages' own modules must have no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dp_runtime", "dispatcher", "graph", "buffers", "launch")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The runtime modules ``path`` imports (``from pkg import mod`` counts as ``pkg.mod``
    when that is a module, as a cycle checker counts it: the package's ``__init__`` that runs
    first is already importing or imported)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # "from pkg import mod" imports the module pkg.mod; "from pkg import name" pkg itself.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            # The deepest runtime module the name refers to ("pkg.mod.Class" -> "pkg.mod").
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = [f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_sees_the_runtime_imports():
    graph = import_graph()
    assert "dp_runtime.sync.errors" in graph["dp_runtime.sync.step_sync"]
    assert "dp_runtime.serving.request" in graph["dp_runtime.serving.admission"]


def test_runtime_packages_have_no_import_cycle():
    graph = import_graph()
    cycles = []
    while (cycle := find_cycle(graph)) is not None:  # every cycle, one edge at a time
        cycles.append(" -> ".join(cycle))
        graph[cycle[-2]].discard(cycle[-1])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
