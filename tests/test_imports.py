"""The package's imports flow one way: no module reaches, directly or through others, back to itself.

Every import counts, including those inside functions (a deferred import hides a circle, it does not remove it).
The graph is read from the source with ``ast``, so the test sees what Python would import, not what happened to be
imported already.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rope_patch"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(importer: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The internal modules an import statement loads: ``from .x import y`` is ``pkg.x.y`` when that is a module,
    else ``pkg.x`` (a name defined there)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    if node.level:
        package = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    if not base.startswith("rope_patch"):
        return []
    found = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    if len(found) < len(node.names):  # some names are defined in the module itself
        found.append(base)
    return [m for m in found if m in MODULES]


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for node in ast.walk(tree):  # every import, at module level or inside a function
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets.update(resolve(name, node))
        graph[name] = targets - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle_hidden_in_a_function():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("def f():\n    from ..patching import patch\n")
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert resolve("rope_patch.eval.sweep", node) == ["rope_patch.patching"]


@pytest.mark.parametrize("lower, upper", [
    ("rope_patch.methods", ("rope_patch.patching", "rope_patch.loading", "rope_patch.eval", "rope_patch.train",
                            "rope_patch.jobs", "rope_patch.cli", "torch.nn", "transformers")),
    ("rope_patch.patching", ("rope_patch.loading", "rope_patch.export", "rope_patch.eval", "rope_patch.train",
                             "rope_patch.jobs", "rope_patch.cli")),
    ("rope_patch.export", ("rope_patch.eval", "rope_patch.train", "rope_patch.jobs", "rope_patch.cli")),
    ("rope_patch.eval", ("rope_patch.train", "rope_patch.jobs", "rope_patch.cli")),
    ("rope_patch.train", ("rope_patch.eval", "rope_patch.jobs", "rope_patch.cli")),
    ("rope_patch.jobs", ("rope_patch.cli",)),
])
def test_rooms_import_only_downwards(lower, upper):
    """The maths knows no model; surgery knows no jobs; evaluation and training know nothing of each other."""
    offenders = []
    for name, path in MODULES.items():
        if name != lower and not name.startswith(lower + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = resolve(name, node) + [getattr(node, "module", None) or ""] + [
                    a.name for a in node.names]
                offenders += [f"{name} imports {t}" for t in targets
                              if any(t == u or t.startswith(u + ".") for u in upper)]
    assert not offenders, offenders
