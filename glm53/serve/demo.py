"""The demo models `glm53 serve` runs when no model is configured: generated once, then reused, and their sizing.

The random-weight HF checkpoint runs on the CPU reference backend; on a host with exllamav3 and a GPU, a tiny
synthetic EXL3 checkpoint runs on the exllamav3 engine in exact mode instead.

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
from typing import Any

from glm53.planning.spec import EngineSpec, engine_spec

log = logging.getLogger("glm53.engine")

DEMO_DIR = "demo-model"
MARKER = ".glm53-demo.json"
# Bump RECIPE when the generator's output changes, so caches from older versions are rebuilt.
RECIPE = {"recipe": 4, "seed": 0, "hidden": 64, "layers": 4, "experts": 8, "top_k": 2, "context": 131072,
          "ends_replies": True}
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

EXL3_DEMO_DIR = "demo-model-exl3"
EXL3_DEMO_MARKER = ".glm53-demo-exl3.json"
# Bump when the fixture writer's output changes, so cached demo checkpoints are rebuilt.
EXL3_DEMO_RECIPE = {"recipe": 2, "seed": 0, "router_skew": [0.25, 0.5], "kind": "tiny-exl3"}


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


def ensure_exl3_demo_model(cache_dir: Path) -> Path:
    """The tiny synthetic EXL3 demo checkpoint under `cache_dir` (generated once, atomically, like the HF one)."""
    from glm53.fixture.exl3 import write_exl3_checkpoint

    cache_dir = Path(cache_dir)
    final = cache_dir / EXL3_DEMO_DIR

    def complete(path: Path) -> bool:
        try:
            return json.loads((path / EXL3_DEMO_MARKER).read_text()) == EXL3_DEMO_RECIPE
        except (OSError, ValueError):
            return False

    if complete(final):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("demo: generating the synthetic EXL3 demo model into %s (once)", final)
    work = Path(tempfile.mkdtemp(prefix=f".{EXL3_DEMO_DIR}-", dir=cache_dir))
    work.chmod(0o755)
    try:
        write_exl3_checkpoint(work, seed=EXL3_DEMO_RECIPE["seed"], router_skew=tuple(EXL3_DEMO_RECIPE["router_skew"]))
        (work / EXL3_DEMO_MARKER).write_text(json.dumps(EXL3_DEMO_RECIPE))
        if final.exists():
            if complete(final):  # another process finished first
                shutil.rmtree(work, ignore_errors=True)
                return final
            shutil.rmtree(final)
        os.replace(work, final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return final


def demo_spec(model_dir: Path, settings: Any, device: str = "cuda:0") -> EngineSpec:
    """The no-model demo on a GPU: the tiny EXL3 fixture in exact mode with a quarter of its experts in VRAM, so
    the demo exercises the tiers and the PCIe lane like the real model does."""
    from glm53.planning.plan import DEMO_CONTEXT
    from glm53.planning.settings import concurrency_of
    from glm53.planning.shape import from_checkpoint

    shape = from_checkpoint(model_dir)
    return engine_spec("exact", moe_layers=shape.moe_layers, experts_per_layer=shape.experts_per_layer,
                       top_k=shape.top_k, vram_slots=max(1, shape.experts_per_layer // 4),
                       kv_tokens=min(settings.context, DEMO_CONTEXT["gpu"]),
                       context=min(settings.context, shape.max_context or settings.context),
                       max_concurrency=concurrency_of(settings)[0], device=device, split="a quarter of each layer")


def demo_engine(cache_dir: Path, settings: Any) -> tuple[Any, Path]:
    """The exllamav3 engine on the synthetic EXL3 demo checkpoint (not loaded), and the checkpoint."""
    from glm53.engine.exl3_engine import Exl3Engine

    model_dir = ensure_exl3_demo_model(Path(cache_dir).expanduser())
    return Exl3Engine(model_dir, demo_spec(model_dir, settings), model_id=settings.model_id), model_dir
