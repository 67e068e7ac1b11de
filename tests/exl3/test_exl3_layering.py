"""The layering of the engine, checked on the source (every import, lazy ones inside functions included).

- Only glm53/exl3 touches exllamav3: no other glm53 module imports it, or looks it up by name (find_spec,
  import_module), so an exllamav3 upgrade is met in one package.
- glm53/engine (the request engines) and glm53/exl3 under it take their sizes from an EngineSpec: neither imports
  the plan, the settings, the model's shape, the layer split, the host facts (as top-level modules or inside
  glm53.planning), the planning CLI, the fixture writers, the composition (glm53.serve) or the benches.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GLM53 = ROOT / "glm53"
EXL3 = GLM53 / "exl3"
DECISIONS = ("plan", "settings", "shape", "split", "host")
BELOW_THE_PLAN = (*(f"glm53.{m}" for m in DECISIONS), *(f"glm53.planning.{m}" for m in DECISIONS),
                  "glm53.plan_cli", "glm53.settings_cli", "glm53.fixture", "glm53.serve", "glm53.server",
                  "glm53.bench")
LOOKUPS = ("find_spec", "import_module", "__import__")


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module `path` imports (for `from a import b`, both a and a.b) and every module it looks up by a
    string constant (importlib.util.find_spec("x"), importlib.import_module("x"))."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the module's package
                up = package[: len(package) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in LOOKUPS:
                out.add(node.args[0].value)
    return out


def offending(modules: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden))


def sources(under: Path) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


def test_only_glm53_exl3_touches_exllamav3():
    files = [p for p in sources(GLM53) if EXL3 not in p.parents]
    assert len(files) > 50
    bad = {str(p.relative_to(ROOT)): offending(imported_modules(p), ("exllamav3",)) for p in files}
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}
    assert any(offending(imported_modules(p), ("exllamav3",)) for p in sources(EXL3))  # the scan sees it there


def test_the_engine_and_exl3_import_nothing_of_the_plan_fixture_or_composition():
    files = sources(GLM53 / "engine") + sources(EXL3)
    assert len(files) >= 15
    bad = {str(p.relative_to(ROOT)): offending(imported_modules(p), BELOW_THE_PLAN) for p in files}
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}


def test_the_scan_catches_each_kind_of_import(tmp_path):
    pkg = tmp_path / "glm53" / "engine"
    pkg.mkdir(parents=True)
    src = pkg / "m.py"

    def scanned(text: str) -> set[str]:
        src.write_text(text + "\n")
        return imported_modules(src, tmp_path)

    for line in ("import exllamav3", "from exllamav3.generator.filter import LLGuidanceFilter",
                 "def f():\n    import exllamav3 as exl", "import importlib.util\nimportlib.util.find_spec('exllamav3')",
                 "import importlib\nimportlib.import_module('exllamav3.modules.mla_attn')"):
        assert offending(scanned(line), ("exllamav3",)), line
    for line in ("from glm53.plan import DEMO_CONTEXT", "from glm53.planning.settings import concurrency_of",
                 "from glm53 import shape", "from glm53.planning import split", "import glm53.host",
                 "def f():\n    from glm53.fixture.hf import write_hf_checkpoint", "from ..serve import demo",
                 "from glm53.plan_cli import gather"):
        assert offending(scanned(line), BELOW_THE_PLAN), line
    assert offending(scanned("from glm53.spec import PAGE\nfrom glm53.planning.spec import EngineSpec\n"
                             "from glm53.planning.devices import share_of_layer\nfrom glm53.exl3 import contract\n"
                             "from .worker import WorkerEngine\nimport exllamav3_like"),
                     (*BELOW_THE_PLAN, "exllamav3")) == []

