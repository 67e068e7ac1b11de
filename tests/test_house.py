"""The whole house's import rules, checked on the source (docs/architecture.md, "What each package may import").

Every module under glm53/ and store/ is parsed (ast: imports at the top, in functions and in classes alike) into
one graph of module -> module edges, and two things are asserted on it:

- no import cycle between modules (each cycle is reported with its edges, file and line);
- the layer order: RULES below, one row per package, says what it may not import.

An edge `from a import b` points at the module a.b when b is one, else at a; an edge to a module outside the house
(torch, exllamav3, ...) is kept by its full name. "At import time" means the imports a module runs when it is
imported (not those inside a function or under `if TYPE_CHECKING:`), followed through the house's own modules.

Beside the imports, two censuses: no function on the decode path (DECODE_PATH) is over MAX_FUNCTION_LINES
lines, and no two classes of the house share a name (SHARED_NAMES lists the one pair that stays, and why).

KNOWN lists the edges that break a rule today and are being fixed by the merge of #37 (each colleague's branch
removes its own): the test passes with them and fails on any new one. The merge empties KNOWN.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The decision layer: one package. Below it in the flow, the machinery it hands an EngineSpec to.
DECISION = ("glm53.planning",)
BELOW_DECISIONS = ("glm53.tiers", "glm53.cpu_lane", "glm53.engine", "glm53.step", "glm53.exl3", "glm53.server",
                   "glm53.serve", "glm53.bench")
# What the machinery may take from the decision package: the sizes it is handed (spec, devices), the byte units
# and the saved routing statistics; never the plan, the settings, the host facts or the model's shape.
DECIDING = tuple(f"glm53.planning.{m}" for m in ("plan", "inputs", "settings", "split", "host", "shape"))
EVERYTHING = ("glm53", "store")


@dataclass(frozen=True)
class Rule:
    who: tuple[str, ...]  # module prefixes the rule is about
    may_not: tuple[str, ...]  # module prefixes they may not import
    why: str
    but: tuple[str, ...] = ()  # prefixes of `who` the rule leaves out
    at_import: bool = False  # only what importing the module runs, followed through the house's modules


RULES = (
    Rule(("store",), ("glm53",), "the store runs alone in the bare pack-store container; glm53 imports it"),
    Rule(DECISION, ("torch",), "decisions are plain Python and numpy: `glm53 plan` runs where torch is not",
         at_import=True),
    Rule(DECISION, BELOW_DECISIONS, "decisions flow down as an EngineSpec; nothing below is read back up",
         but=("glm53.planning.inputs",)),  # inputs gathers host facts at the edge: the lane kernel's check
    Rule(("glm53.tiers", "glm53.cpu_lane"),
         ("glm53.step", "glm53.exl3", "glm53.engine", "glm53.server", "glm53.serve", "glm53.bench", *DECIDING),
         "the machinery under the step takes its sizes from an EngineSpec"),
    Rule(("glm53.step",),
         ("glm53.exl3", "glm53.engine", "glm53.server", "glm53.serve", "glm53.bench", "exllamav3", *DECIDING),
         "the step decides where each pick is read from, over the tiers; the seam in glm53.exl3 calls it"),
    Rule(("glm53.exl3", "glm53.engine"),
         ("glm53.server", "glm53.serve", "glm53.bench", "glm53.fixture", "glm53.plan_cli", *DECIDING),
         "the engine runs the spec it is handed; the composition (glm53.serve) chose it"),
    Rule(("glm53.server",),
         ("glm53.planning.plan", "glm53.planning.inputs", "glm53.plan_cli", "glm53.fixture", "glm53.serve",
          "glm53.bench"),
         "the server is handed an Engine and settings, and decides nothing about them"),
    Rule(EVERYTHING, ("glm53.bench",), "benchmarks drive the product, never the reverse", but=("glm53.bench",)),
    Rule(EVERYTHING, ("exllamav3",), "one place touches exllamav3, so an upgrade fails loudly there",
         but=("glm53.exl3",)),
)

# Edges that break a rule or close a cycle and stay, each with its reason (none today). For an at-import rule the edge is the
# chain's first step.
KNOWN: set[tuple[str, str]] = set()


# ------------------------------------------------------------------------------------------------ the graph


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    where: str  # path:line
    at_import: bool
    type_only: bool = False  # under `if TYPE_CHECKING:`: an annotation's name, never run


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def house_modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for top in EVERYTHING for p in sorted((root / top).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, at_import: bool = True, types: bool = False):
    """(import node, whether it runs at import time, whether only type checkers see it), in source order."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, at_import, types
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _imports(node, False, types)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), False, True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), at_import, types)
        else:
            yield from _imports(node, at_import, types)


def edges_of(name: str, path: Path, modules: dict[str, Path], root: Path) -> list[Edge]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node, now, types in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        where = f"{path.relative_to(root)}:{node.lineno}"
        out += [Edge(name, dst, where, now, types) for dst in dict.fromkeys(targets) if dst != name]
    return out


def house_graph(root: Path) -> list[Edge]:
    modules = house_modules(root)
    return [e for name, path in modules.items() for e in edges_of(name, path, modules, root)]


@pytest.fixture(scope="module")
def house() -> list[Edge]:
    edges = house_graph(ROOT)
    assert len({e.src for e in edges}) > 100  # the scan sees the house
    return edges


def under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# ------------------------------------------------------------------------------------------------ the checks


def cycles(edges: list[Edge]) -> list[list[Edge]]:
    """Each strongly connected component of more than one module, as the edges inside it (Tarjan, iterative)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        graph[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    components.append(sorted((e for e in edges if e.src in component and e.dst in component),
                                             key=lambda e: (e.src, e.dst, e.where)))
    return components


def violations(edges: list[Edge], rule: Rule) -> list[tuple[str, str, str]]:
    """(importer, imported, how) for each edge breaking `rule`; at_import rules follow import-time edges through
    the house's modules, and name the chain."""
    def applies(m: str) -> bool:
        return under(m, rule.who) and not under(m, rule.but)

    if not rule.at_import:
        return sorted({(e.src, e.dst, e.where) for e in edges if applies(e.src) and under(e.dst, rule.may_not)})
    now: dict[str, list[Edge]] = defaultdict(list)
    for e in edges:
        if e.at_import:
            now[e.src].append(e)
    found = set()
    for start in sorted({e.src for e in edges if applies(e.src)}):
        seen, todo = {start}, [(start, ())]
        while todo:
            m, chain = todo.pop()
            for e in now[m]:
                if under(e.dst, rule.may_not):
                    first = chain[0] if chain else e
                    found.add((start, first.dst, " -> ".join(x.where for x in (*chain, e))))
                elif e.dst not in seen:
                    seen.add(e.dst)
                    todo.append((e.dst, (*chain, e)))
    return sorted(found)


def test_the_house_has_no_import_cycle(house):
    # A name imported for annotations only (a part naming the whole it serves) neither loads nor runs the other
    # module, so it closes no cycle; every import that runs, at import or later in a function, counts.
    edges = [e for e in house if (e.src, e.dst) not in KNOWN and not e.type_only]
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(
        "  " + " | ".join(f"{e.src} -> {e.dst} ({e.where})" for e in c) for c in found)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.who[0]}-may-not-import-{r.may_not[0]}")
def test_each_package_imports_only_what_its_layer_may(house, rule):
    new = [v for v in violations(house, rule) if (v[0], v[1]) not in KNOWN]
    assert not new, f"{rule.why}:\n" + "\n".join(f"  {src} imports {dst} ({how})" for src, dst, how in new)


def test_known_breaks_are_the_ones_still_there(house):
    """KNOWN names only edges the house has: an edge a branch of #37 removes leaves KNOWN with it, so that KNOWN
    cannot hide the same edge coming back."""
    assert KNOWN <= {(e.src, e.dst) for e in house}


# ------------------------------------------------------------------------------------------------ the scan itself


def _tree(root: Path, files: dict[str, str]) -> list[Edge]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return house_graph(root)


def test_the_scan_sees_every_kind_of_import_and_when_it_runs(tmp_path):
    edges = _tree(tmp_path, {
        "glm53/__init__.py": "",
        "glm53/planning/__init__.py": "",
        "glm53/planning/plan.py": "import numpy\nfrom glm53.planning import split\n",
        "glm53/planning/split.py": "def f():\n    from glm53.planning.plan import X\n",
        "glm53/planning/spec.py": "class S:\n    from glm53.tiers import policy\n",
        "glm53/tiers/__init__.py": "",
        "glm53/tiers/policy.py": "import torch\nfrom . import arena\nfrom .arena import Slot\n",
        "glm53/tiers/arena.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from glm53.engine import x\n",
        "store/__init__.py": "",
        "store/pack.py": "import glm53.tiers.policy as p\n",
    })
    got = {(e.src, e.dst, e.at_import) for e in edges}
    assert got == {
        ("glm53.planning.plan", "numpy", True), ("glm53.planning.plan", "glm53.planning.split", True),
        ("glm53.planning.split", "glm53.planning.plan", False),
        ("glm53.tiers.policy", "torch", True), ("glm53.tiers.policy", "glm53.tiers.arena", True),
        ("glm53.tiers.arena", "typing", True), ("glm53.tiers.arena", "glm53.engine", False),
        ("glm53.planning.spec", "glm53.tiers.policy", True), ("store.pack", "glm53.tiers.policy", True)}
    assert [e.dst for e in edges if e.type_only] == ["glm53.engine"]
    assert [sorted({e.src for e in c}) for c in cycles(edges)] == [["glm53.planning.plan", "glm53.planning.split"]]
    # torch reached at import time through the house's own modules is named with its chain
    assert violations(edges, RULES[1]) == [("glm53.planning.spec", "glm53.tiers.policy",
                                            "glm53/planning/spec.py:2 -> glm53/tiers/policy.py:1")]
    assert [v[:2] for v in violations(edges, RULES[0])] == [("store.pack", "glm53.tiers.policy")]


# ------------------------------------------------------------------------------------------------ function size

# The decode path's product code, where every function is read whole when the hot path changes: the step, the tiers
# and the CPU lane it reads through, and the two glm53.exl3 modules it runs under (the seam, the runtime driving
# the generator). Set-up code in these places (constructors, the nvme tier's opening) is held to the same size: it
# sits beside the step and is read with it.
DECODE_PATH = ("glm53/step", "glm53/tiers", "glm53/cpu_lane", "glm53/exl3/tiered.py", "glm53/exl3/runtime.py")
MAX_FUNCTION_LINES = 60


def function_sizes(root: Path, places: tuple[str, ...] = DECODE_PATH) -> list[tuple[str, int]]:
    """(path:line qualified.name, lines from its first decorator to its last line) for every function and method,
    nested ones too (a nested function counts in its parent's lines as well), in the Python files of `places`."""
    out = []

    def visit(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    out.append((f"{path}:{child.lineno} {name}", child.end_lineno - first + 1))
                visit(child, path, name + ".")
            else:
                visit(child, path, prefix)

    for place in places:
        where = root / place
        for f in sorted(where.rglob("*.py")) if where.is_dir() else [where]:
            visit(ast.parse(f.read_text(), str(f)), str(f.relative_to(root)), "")
    return out


def test_no_function_on_the_decode_path_is_over_sixty_lines():
    sizes = function_sizes(ROOT)
    assert len(sizes) > 300  # the scan sees the decode path
    long = sorted((n, where) for where, n in sizes if n > MAX_FUNCTION_LINES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named helpers):\n" + "\n".join(
        f"  {where}: {n} lines" for n, where in long)


def test_the_size_census_counts_every_function_in_its_places(tmp_path):
    def body(n: int) -> str:  # a function of n lines, one decorator among them
        return "@staticmethod\ndef f():\n" + "    x = 1\n" * (n - 2)

    files = {
        "glm53/step/a.py": "class A:\n    def m(self):\n        def inner():\n            pass\n        return 1\n",
        "glm53/step/deep/b.py": body(61).replace("def f", "async def g"),
        "glm53/exl3/tiered.py": body(60),
        "glm53/exl3/other.py": body(99),  # not on the decode path
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    sizes = dict(function_sizes(tmp_path, ("glm53/step", "glm53/exl3/tiered.py")))
    assert sizes == {"glm53/step/a.py:2 A.m": 4, "glm53/step/a.py:3 A.m.inner": 2,
                     "glm53/step/deep/b.py:2 g": 61, "glm53/exl3/tiered.py:2 f": 60}
    assert [w for w, n in sizes.items() if n > MAX_FUNCTION_LINES] == ["glm53/step/deep/b.py:2 g"]


# ------------------------------------------------------------------------------------------------ class names

# Class names the house defines twice, each with its reason. CheckpointError means one thing in both places (a
# checkpoint directory the user must fix, the message naming the fix): store raises it while packing and imports
# nothing of glm53, glm53.checkpoint while locking and fetching; one class would make store's StoreError handlers
# catch glm53's lock errors, or glm53's handlers miss store's.
SHARED_NAMES = {"CheckpointError": {"glm53/checkpoint.py", "store/errors.py"}}


def class_names(root: Path) -> dict[str, list[str]]:
    """Every class the house defines (nested ones too, private ones too) -> where: path:line."""
    where: dict[str, list[str]] = defaultdict(list)
    for top in EVERYTHING:
        for f in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(f"{f.relative_to(root)}:{node.lineno}")
    return where


def shared_class_names(root: Path, allowed: dict[str, set[str]] = SHARED_NAMES) -> dict[str, list[str]]:
    return {name: at for name, at in sorted(class_names(root).items())
            if len(at) > 1 and {a.rpartition(":")[0] for a in at} != allowed.get(name)}


def test_no_two_classes_share_a_name():
    """One name, one thing: a reader (or grep) that meets `Plan` or `Step` knows which one it is."""
    assert len(class_names(ROOT)) > 200  # the scan sees the house
    shared = shared_class_names(ROOT)
    assert not shared, "class names defined more than once (rename one to what it is):\n" + "\n".join(
        f"  {name}: {', '.join(at)}" for name, at in shared.items())


def test_the_class_census_sees_nested_and_private_classes(tmp_path):
    files = {
        "glm53/server/a.py": "class Step:\n    pass\ndef f():\n    class _Inner:\n        pass\n",
        "glm53/step/b.py": "class Holder:\n    class Step:\n        pass\nclass _Inner:\n    pass\n",
        "store/c.py": "class Once:\n    pass\nclass Twice:\n    pass\n",
        "glm53/d.py": "class Twice:\n    pass\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert shared_class_names(tmp_path, {}) == {
        "Step": ["glm53/server/a.py:1", "glm53/step/b.py:2"], "Twice": ["glm53/d.py:1", "store/c.py:3"],
        "_Inner": ["glm53/server/a.py:4", "glm53/step/b.py:4"]}
    # an allowed pair is allowed only where it is: a third definition is reported again
    assert "Twice" not in shared_class_names(tmp_path, {"Twice": {"glm53/d.py", "store/c.py"}})
    (tmp_path / "glm53/e.py").write_text("class Twice:\n    pass\n")
    assert "Twice" in shared_class_names(tmp_path, {"Twice": {"glm53/d.py", "store/c.py"}})


def test_make_test_prints_where_the_time_goes():
    recipe = (ROOT / "Makefile").read_text().split("\ntest:")[1].split("\n\n")[0]
    assert "--durations=15" in recipe, recipe
