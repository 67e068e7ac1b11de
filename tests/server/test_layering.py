"""The direction of flow, checked on the source: settings -> host facts -> plan -> engine -> server.

The server package receives an Engine (glm53.serve composes it); it must not reach back into planning, the
CLI that prints plans, or the test-checkpoint generator.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "glm53" / "server"
FORBIDDEN = ("glm53.plan_cli", "glm53.planning.plan", "glm53.planning.inputs", "glm53.fixture", "glm53.serve")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative: resolve against glm53.server
                base = ["glm53", "server"][: max(0, 3 - node.level)]
                out.add(".".join([*base, node.module]))
            else:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def offending(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))


def test_the_server_package_imports_no_planning_or_fixture(tmp_path):
    files = sorted(SERVER.glob("*.py"))
    assert len(files) >= 8
    bad = {p.name: offending(imported_modules(p)) for p in files}
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}


def test_the_scan_catches_each_kind_of_import(tmp_path):
    src = tmp_path / "m.py"
    for line in ("from glm53.fixture.tokenizer import THINK_OPEN", "import glm53.plan_cli",
                 "from glm53.planning import plan", "def f():\n    from glm53.serve.choice import choose_engine"):
        src.write_text(line + "\n")
        assert offending(imported_modules(src)), line
    src.write_text("from glm53.markup import THINK_OPEN\nfrom glm53.engine.interface import Engine\n"
                   "from glm53 import planner_free\n")
    assert offending(imported_modules(src)) == []


def test_markup_is_one_definition():
    from glm53 import markup
    from glm53.fixture import tokenizer
    from glm53.server import chat

    for name in ("THINK_OPEN", "THINK_CLOSE", "TOOL_CALL_OPEN", "USER", "ASSISTANT", "EOS_TOKENS"):
        assert getattr(tokenizer, name) is getattr(markup, name)
    assert chat.TOOL_CALL_OPEN is markup.TOOL_CALL_OPEN
