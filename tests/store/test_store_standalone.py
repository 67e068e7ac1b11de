"""store/ stands alone: it runs in the bare pack-store container, so none of its modules imports glm53 (glm53
imports store, never the other way round), at import time or inside a function."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STORE = REPO / "store"


def store_modules() -> list[str]:
    return sorted(f"store.{p.stem}" for p in STORE.glob("*.py") if p.stem != "__init__")


def imported_names(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement in the file names, with its line (relative imports resolved to store.)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append((node.lineno, "store." + (node.module or "") if node.level else node.module or ""))
    return names


def test_no_store_module_names_glm53_in_an_import():
    found = [f"{p.relative_to(REPO)}:{line}: {name}" for p in sorted(STORE.rglob("*.py"))
             for line, name in imported_names(p) if name == "glm53" or name.startswith("glm53.")]
    assert found == [], "store/ imports glm53:\n" + "\n".join(found)


def test_the_scan_sees_an_import_inside_a_function(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from glm53.planning.settings import load\n    import glm53.cpu_lane.kernel as k\n")
    assert [n for _, n in imported_names(probe)] == ["glm53.planning.settings", "glm53.cpu_lane.kernel"]


def test_every_store_module_imports_and_reads_with_glm53_unimportable(tmp_path):
    """In a fresh interpreter that refuses to import glm53, every store module imports, the native library loads
    and a store packed from a synthetic checkpoint is verified and read back through the reader."""
    code = f"""
import importlib, sys

class NoGlm53:
    def find_spec(self, name, path=None, target=None):
        if name == "glm53" or name.startswith("glm53."):
            raise ImportError(f"store imported {{name}}")

sys.meta_path.insert(0, NoGlm53())
for name in {store_modules()!r}:
    importlib.import_module(name)
from pathlib import Path
from store import native
from store.directio import alloc_aligned
from store.pack import PackOptions, pack_store
from store.reader import StoreReader
from store.synth import write_expert_checkpoint
from store.verify import full_verify

native.library()
root = Path({str(tmp_path)!r})
ck = write_expert_checkpoint(root / "ck", layers=3, experts=4, seed=1)
out = root / "s.glm53"
pack_store(PackOptions(ck, out, verify=False, allow_buffered=True, progress=False), log=lambda m: None)
assert full_verify(out, ck, allow_buffered=True).ok
with StoreReader(out, allow_buffered=True, verify=True) as r:
    buf = alloc_aligned(r.max_extent)
    for layer, expert in r.keys():
        r.read(layer, expert, buf).result(10)
assert not any(m == "glm53" or m.startswith("glm53.") for m in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
