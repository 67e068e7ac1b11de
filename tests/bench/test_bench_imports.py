"""No product module imports the bench package: benchmarks drive the product, never the other way round."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bench_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        if isinstance(node, ast.ImportFrom) and node.module == "glm53":
            names += [f"glm53.{a.name}" for a in node.names]
        found += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                  if n == "glm53.bench" or n.startswith("glm53.bench.")]
    return found


def test_no_product_module_imports_glm53_bench():
    product = [p for root in ("glm53", "store") for p in (REPO / root).rglob("*.py")
               if "bench" not in p.relative_to(REPO).parts[:2]]
    assert len(product) > 50
    assert [hit for p in product for hit in bench_imports(p)] == []


def test_the_scan_sees_an_import(tmp_path):
    bad = REPO / "glm53" / "_scan_probe.py"  # inside the repo: the scan names paths relative to it
    try:
        bad.write_text("from glm53.bench import decode\nimport glm53.bench.worktree\nfrom glm53 import bench\n")
        assert len(bench_imports(bad)) == 3
    finally:
        bad.unlink()
