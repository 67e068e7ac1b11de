"""The demo model `glm53 serve` runs when no model is configured: generated once, then reused.

Generation is atomic: the checkpoint is built in a sibling temp directory and renamed into place, with a
marker file written last, so an interrupted first start (Ctrl-C, OOM, full disk) never leaves a directory
that looks complete. A directory whose marker does not match the current recipe is rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger("glm53.engine")

DEMO_DIR = "demo-model"
MARKER = ".glm53-demo.json"
# Bump RECIPE when the generator's output changes, so caches from older versions are rebuilt.
RECIPE = {"recipe": 4, "seed": 0, "hidden": 64, "layers": 4, "experts": 8, "top_k": 2, "context": 131072,
          "ends_replies": True}
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _complete(path: Path) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == RECIPE and all((path / name).is_file() for name in REQUIRED)


def ensure_demo_model(cache_dir: Path) -> Path:
    """Path of the demo checkpoint under `cache_dir`, generating it first if it is absent or incomplete."""
    from glm53.fixture.hf import write_hf_checkpoint

    cache_dir = Path(cache_dir)
    final = cache_dir / DEMO_DIR
    if _complete(final):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("demo: generating the random-weight demo model into %s (once)", final)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=f".{DEMO_DIR}-", dir=cache_dir))
    work.chmod(0o755)  # mkdtemp's 0700 would lock out other users of a shared cache volume
    try:
        params = {k: v for k, v in RECIPE.items() if k != "recipe"}
        write_hf_checkpoint(work, **params)
        (work / MARKER).write_text(json.dumps(RECIPE))
        with open(work / MARKER, "rb") as f:
            os.fsync(f.fileno())
        if final.exists():  # stale or partial: replace it (another process may have just finished one)
            if _complete(final):
                shutil.rmtree(work, ignore_errors=True)
                return final
            shutil.rmtree(final)
        try:
            os.replace(work, final)
        except OSError:
            if not _complete(final):  # lost a race to a process that published a complete one: use it
                raise
            shutil.rmtree(work, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("demo: model ready in %.1f s", time.perf_counter() - t0)
    return final
