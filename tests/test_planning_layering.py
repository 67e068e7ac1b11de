"""The decision package's arrows, checked on the source: nothing above it, and no cycle inside it.

glm53.planning decides from settings, host facts and the model's shape; the engine, the tiers and the server sit
above it and take what it decides (the EngineSpec). So its modules import only each other, store (the one
safetensors header reader) and, at the edge (inputs), the CPU lane's kernel check, a fact of this host.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "glm53" / "planning"
EDGE = {"inputs": {"glm53.cpu_lane"}}  # what the input gatherer may read beside the package


def glm53_imports(path: Path) -> set[str]:
    """Every glm53 module `path` imports, at module level or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            if node.module == "glm53.planning":
                out.update(f"glm53.planning.{a.name}" for a in node.names)
    return {m for m in out if m == "glm53" or m.startswith("glm53.")}


def modules() -> dict[str, set[str]]:
    return {p.stem: glm53_imports(p) for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"}


def test_the_package_imports_nothing_above_it():
    bad = {}
    for name, imports in modules().items():
        allowed = EDGE.get(name, set())
        out = sorted(m for m in imports if not m.startswith("glm53.planning")
                     and not any(m == a or m.startswith(a + ".") for a in allowed))
        if out:
            bad[name] = out
    assert not bad, bad


def test_no_cycle_inside_the_package():
    graph = {name: {m.removeprefix("glm53.planning.") for m in imports if m.startswith("glm53.planning.")}
             for name, imports in modules().items()}
    assert {"plan", "split", "spec", "settings", "inputs", "routing"} <= set(graph)
    state: dict[str, int] = {}

    def visit(node: str, path: tuple[str, ...]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, " -> ".join((*path, node, nxt))
            if nxt not in state:
                visit(nxt, (*path, node))
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, ())
    assert "plan" not in graph["split"]  # the split prices cards; the plan calls it, never the reverse
