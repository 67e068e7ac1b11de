"""Which engine `glm53 serve` runs, decided from the settings and the checkpoint directory.

- No model configured: the random-weight demo model, generated once into the cache directory, on the CPU
  reference backend.
- An HF bf16 Glm5Next checkpoint: the CPU reference backend (meant for small checkpoints: tests, demos).
- An EXL3 checkpoint: the exllamav3 engine (glm53.engine.exl3_engine) on the plan's GPU, in the plan's mode
  (fast, exact, nvme, nvme-exact; stock exllamav3 when every expert fits in VRAM); without exllamav3 or a CUDA
  GPU start-up stops with a message saying so.
- No model on a host with exllamav3 and a GPU: the synthetic EXL3 demo model through the exllamav3 engine.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEMO_BANNER = ("random-weight demo model; set GLM53_MODEL_DIR=/path/to/GLM-5.3-Flash-exl3 to serve the real one")


class EngineChoiceError(RuntimeError):
    """Start-up cannot serve this configuration; the message says why and what to do (exit status 2)."""


@dataclass
class EngineChoice:
    engine: Any
    model_dir: Path
    demo: bool
    banner: list[str]
    warnings: list[str] = field(default_factory=list)


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineChoiceError(f"{model_dir} has no config.json: is GLM53_MODEL_DIR a checkpoint directory "
                                f"(and is it mounted)?") from None
    except (OSError, ValueError) as exc:
        raise EngineChoiceError(f"cannot read {path}: {exc}") from None


def checkpoint_format(config: dict) -> str:
    """ "exl3" | "hf" (unquantized Glm5Next) | "unknown"."""
    quant = config.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() == "exl3":
        return "exl3"
    archs = " ".join(config.get("architectures") or [])
    model_type = str(config.get("model_type", ""))
    if "Glm5Next" in archs or model_type.startswith("glm5_next"):
        return "hf"
    return "unknown"


def model_context(config: dict) -> int | None:
    text = config.get("text_config") or config
    value = text.get("max_position_embeddings")
    return int(value) if value else None


def exllamav3_available() -> bool:
    return importlib.util.find_spec("exllamav3") is not None


def _reference(model_dir: Path, settings: Any, config: dict) -> Any:
    from glm53.engine.reference import ReferenceEngine

    native = model_context(config)
    context = min(settings.context, native) if native else settings.context
    return ReferenceEngine(model_dir, model_id=settings.model_id, context_length=context,
                           max_running=settings.max_concurrency)


def _exl3(model_dir: Path, settings: Any) -> EngineChoice:
    from glm53.engine.exl3_engine import engine_for_plan, gpu_engine_available
    from glm53.plan import PlanError
    from glm53.planning_cli import current_plan

    if not gpu_engine_available():
        raise EngineChoiceError(f"{model_dir} is an EXL3 checkpoint: serving it needs a CUDA GPU, and torch sees none "
                                f"here. Run the container with --gpus all, or leave GLM53_MODEL_DIR empty for the demo.")
    try:
        plan, inp = current_plan(settings.with_overrides(model_dir=str(model_dir)))
    except PlanError as exc:
        raise EngineChoiceError(str(exc)) from None
    engine = engine_for_plan(model_dir, settings, plan, inp.shape)
    banner = [f"serving {model_dir} (EXL3) on the exllamav3 engine, {engine.mode} mode, plan mode {plan.mode}",
              *plan.warnings]
    return EngineChoice(engine, model_dir, False, banner)


def choose_engine(settings: Any) -> EngineChoice:
    if not settings.model_dir:
        choice = _demo(settings)
        if settings.store:
            choice.warnings.append(f"GLM53_STORE={settings.store} is ignored: GLM53_MODEL_DIR is empty, and the "
                                   "demo model uses no store; set GLM53_MODEL_DIR to the checkpoint the store was "
                                   "packed from (or unset GLM53_STORE)")
        return choice
    return _configured(settings)


def _demo(settings: Any) -> EngineChoice:
    from glm53.engine.exl3_engine import demo_engine, gpu_engine_available

    if gpu_engine_available():
        engine, model_dir = demo_engine(Path(settings.cache_dir), settings)
        return EngineChoice(engine, model_dir, True, [DEMO_BANNER, f"demo checkpoint {model_dir} (synthetic EXL3) "
                                                      "on the exllamav3 engine, exact mode (output is random text)"])
    from glm53.engine.demo import ensure_demo_model

    model_dir = ensure_demo_model(Path(settings.cache_dir))
    config = read_config(model_dir)
    banner = [DEMO_BANNER,
              f"demo checkpoint {model_dir} on the CPU reference backend (output is random text)"]
    return EngineChoice(_reference(model_dir, settings, config), model_dir, True, banner)


def _configured(settings: Any) -> EngineChoice:
    model_dir = Path(settings.model_dir).expanduser()
    if not model_dir.is_dir():
        raise EngineChoiceError(f"GLM53_MODEL_DIR={settings.model_dir} is not a directory.")
    config = read_config(model_dir)
    fmt = checkpoint_format(config)
    if fmt == "exl3":
        if not exllamav3_available():
            raise EngineChoiceError(
                f"{model_dir} is an EXL3 checkpoint: serving it needs exllamav3 on a CUDA GPU, and exllamav3 is "
                f"not installed here. Use the glm53 Docker image (or `pip install 'glm53[gpu]'` on a CUDA host), "
                f"or leave GLM53_MODEL_DIR empty to serve the demo model on the CPU.")
        return _exl3(model_dir, settings)
    if fmt == "hf":
        banner = [f"serving {model_dir} (HF bf16 Glm5Next) on the CPU reference backend"]
        return EngineChoice(_reference(model_dir, settings, config), model_dir, False, banner)
    raise EngineChoiceError(f"{model_dir}/config.json is neither an EXL3 nor an HF Glm5Next checkpoint "
                            f"(architectures={config.get('architectures')}, model_type={config.get('model_type')}).")
