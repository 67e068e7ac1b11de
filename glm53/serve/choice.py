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

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("glm53.serve")

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
    """config.json, checked as far as start-up reads it (glm53.planning.shape.load_config)."""
    from glm53.planning.shape import ShapeError, load_config

    if not (model_dir / "config.json").exists():
        raise EngineChoiceError(f"{model_dir} has no config.json: is GLM53_MODEL_DIR a checkpoint directory "
                                f"(and is it mounted)?")
    try:
        return load_config(model_dir)
    except ShapeError as exc:
        raise EngineChoiceError(str(exc)) from None
    except OSError as exc:
        raise EngineChoiceError(f"cannot read {model_dir / 'config.json'}: {exc.strerror}") from None


def tensor_sizes(model_dir: Path) -> dict[str, int]:
    """Tensor name -> bytes, from the safetensors headers (what the loaders read, whatever config.json says)."""
    from glm53.planning.shape import ShapeError, read_safetensors_sizes

    sizes: dict[str, int] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            sizes.update(read_safetensors_sizes(path))
        except ShapeError as exc:
            raise EngineChoiceError(f"{exc}: check the checkpoint with `glm53 model verify {model_dir}`") from None
    return sizes


def checkpoint_format(config: dict, tensors: Any = ()) -> tuple[str, list[str]]:
    """("exl3" | "hf" (unquantized Glm5Next) | "unknown", what config.json gets wrong). The tensors decide
    over config.json: EXL3 weights are `.trellis` tensors, whatever the config claims."""
    quant = config.get("quantization_config") or {}
    says_exl3 = str(quant.get("quant_method", "")).lower() == "exl3"
    trellis = sum(1 for name in tensors if name.endswith(".trellis"))
    if trellis and not says_exl3:
        return "exl3", [f"the checkpoint holds {trellis} EXL3 (.trellis) tensors, but its config.json has no "
                        f"quantization_config with quant_method \"exl3\" (it has {quant or 'none'}): a config from "
                        f"another model? Restore the config.json that came with these weights"]
    if says_exl3:
        return "exl3", []
    archs = " ".join(config.get("architectures") or [])
    model_type = str(config.get("model_type", ""))
    if "Glm5Next" in archs or model_type.startswith("glm5_next"):
        return "hf", []
    return "unknown", []


# The CPU reference backend loads weights in float32: twice the bytes of the bf16 files.
REFERENCE_BYTES_PER_DISK_BYTE = 2


def reference_refusal(model_dir: Path, weight_bytes: int, available: int | None) -> str | None:
    """Why the CPU reference backend cannot hold this checkpoint, or None. It is meant for small checkpoints
    (tests, demos); the real model needs the EXL3 build on a GPU."""
    need = weight_bytes * REFERENCE_BYTES_PER_DISK_BYTE
    if available is None or need <= available:
        return None
    gib = 2**30
    return (f"{model_dir} is {weight_bytes / gib:.1f} GiB of bf16 weights; the CPU reference backend loads them in "
            f"float32, which needs about {need / gib:.1f} GiB of RAM, and {available / gib:.1f} GiB is available. "
            f"It is meant for small test checkpoints: serve the EXL3 checkpoint on a GPU instead.")


def ram_available() -> int | None:
    """What a new allocation can get: MemAvailable, or less under a cgroup cap."""
    from glm53.planning.host import read_memory

    m = read_memory(Path("/"))
    room = [m.available] if m.available is not None else []
    if m.limit is not None:
        room.append(max(0, m.limit - (m.current or 0)))
    return min(room) if room else None


def model_context(config: dict) -> int | None:
    text = config.get("text_config") or config
    value = text.get("max_position_embeddings")
    return int(value) if value else None


def exllamav3_available() -> bool:
    from glm53.exl3 import contract

    return contract.installed()


def _reference(model_dir: Path, settings: Any, config: dict) -> Any:
    from glm53.engine.reference import ReferenceEngine
    from glm53.planning.settings import concurrency_of

    native = model_context(config)
    context = min(settings.context, native) if native else settings.context
    # One context's worth of KV shared by every request, as the GPU engine's cache is (the plan's kv_tokens).
    return ReferenceEngine(model_dir, model_id=settings.model_id, context_length=context,
                           max_running=concurrency_of(settings)[0], kv_tokens=context)


def _exl3(model_dir: Path, settings: Any) -> EngineChoice:
    from glm53.exl3 import contract
    from glm53.planning.inputs import current_plan
    from glm53.planning.plan import PlanError

    if not contract.gpu_available():
        raise EngineChoiceError(f"{model_dir} is an EXL3 checkpoint: serving it needs a CUDA GPU, and torch sees none "
                                f"here. Run the container with --gpus all, or leave GLM53_MODEL_DIR empty for the demo.")
    try:
        plan, inp = current_plan(settings.with_overrides(model_dir=str(model_dir)))
    except PlanError as exc:
        raise EngineChoiceError(str(exc)) from None
    engine = engine_for_plan(model_dir, settings, plan)
    banner = [f"serving {model_dir} (EXL3) on the exllamav3 engine, {engine.mode} mode, plan mode {plan.mode}",
              *plan.warnings]
    return EngineChoice(engine, model_dir, False, banner)


def engine_for_plan(model_dir: Path, settings: Any, plan: Any) -> Any:
    """The engine `glm53 serve` runs for an EXL3 checkpoint on this host's plan: exactly the plan's EngineSpec, and
    the plan's speed forecast for /stats."""
    from glm53.engine.exl3_engine import Exl3Engine

    if plan.engine is None:
        raise ValueError(f"a {plan.mode} plan has no engine spec")
    engine = Exl3Engine(model_dir, plan.engine, model_id=settings.model_id,
                        routing_stats_dir=Path(settings.cache_dir).expanduser())
    engine.forecast = plan.forecast  # /stats shows it beside the measured decode rate
    return engine


def check_cache_dir(cache_dir: str) -> Path:
    """GLM53_CACHE_DIR as a directory (made if missing), or EngineChoiceError saying what is in the way."""
    path = Path(cache_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        what = "a file" if path.is_file() else "not a directory"
        raise EngineChoiceError(f"GLM53_CACHE_DIR={path} is {what}, not a directory (it keeps the demo model, "
                                f"routing statistics and compiled kernels); fix: point GLM53_CACHE_DIR at a "
                                f"directory (it is made if missing), or move {path} away") from None
    except OSError as exc:
        raise EngineChoiceError(f"GLM53_CACHE_DIR={path} cannot be made: {exc.strerror}; fix: point "
                                f"GLM53_CACHE_DIR at a directory this user can write") from None
    return path


def choose_engine(settings: Any) -> EngineChoice:
    check_cache_dir(settings.cache_dir)
    if not settings.model_dir:
        choice = _demo(settings)
        if settings.store:
            choice.warnings.append(f"GLM53_STORE={settings.store} is ignored: GLM53_MODEL_DIR is empty, and the "
                                   "demo model uses no store; set GLM53_MODEL_DIR to the checkpoint the store was "
                                   "packed from (or unset GLM53_STORE)")
    else:
        choice = _configured(settings)
    choice.engine.max_waiting = settings.max_queue  # beyond it, a request is answered 429 at once
    return choice


def _demo(settings: Any) -> EngineChoice:
    from glm53.exl3 import contract
    from glm53.serve.demo import demo_engine, ensure_demo_model

    if contract.gpu_available():
        engine, model_dir = demo_engine(Path(settings.cache_dir), settings)
        return EngineChoice(engine, model_dir, True, [DEMO_BANNER, f"demo checkpoint {model_dir} (synthetic EXL3) "
                                                      "on the exllamav3 engine, exact mode (output is random text)"])
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
    tensors = tensor_sizes(model_dir)
    fmt, notes = checkpoint_format(config, tensors)
    warnings = [f"{model_dir}: {n}" for n in notes]
    for line in checkpoint_identity(model_dir, config):
        log.info("%s", line)  # now: a refusal below (no exllamav3, say) must not hide what identity was found
    if fmt == "exl3":
        if not exllamav3_available():
            raise EngineChoiceError(
                f"{model_dir} is an EXL3 checkpoint: serving it needs exllamav3 on a CUDA GPU, and exllamav3 is "
                f"not installed here. Use the glm53 Docker image (or `pip install 'glm53[gpu]'` on a CUDA host), "
                f"or leave GLM53_MODEL_DIR empty to serve the demo model on the CPU."
                + "".join(f" Also: {w}." for w in warnings))
        choice = _exl3(model_dir, settings)
    elif fmt == "hf":
        refusal = reference_refusal(model_dir, sum(tensors.values()), ram_available())
        if refusal:
            raise EngineChoiceError(refusal)
        banner = [f"serving {model_dir} (HF bf16 Glm5Next) on the CPU reference backend"]
        choice = EngineChoice(_reference(model_dir, settings, config), model_dir, False, banner)
    else:
        raise EngineChoiceError(f"{model_dir}/config.json is neither an EXL3 nor an HF Glm5Next checkpoint "
                                f"(architectures={config.get('architectures')}, model_type={config.get('model_type')}).")
    choice.warnings.extend(warnings)
    return choice


def checkpoint_identity(model_dir: Path, config: dict) -> list[str]:
    """The quick lock check, for a checkpoint that claims to be the pinned model (sizes and the index; sha256 is
    `glm53 model verify`'s): the lines to log, or EngineChoiceError with the fix when it is not the pinned one."""
    from glm53 import checkpoint as C

    try:
        lock = C.lock_for(model_dir, config)
        if lock is None:
            return [f"checkpoint identity: unknown ({model_dir} does not have GLM-5.3-Flash's shape, so no lock "
                    f"applies: a generated or other checkpoint; nothing was verified)"]
        result = C.quick_check(model_dir, lock)
    except C.CheckpointError as exc:
        raise EngineChoiceError(f"{model_dir}: {exc}") from None
    if result.problems:
        listed = "; ".join(result.problems[:3]) + (f"; and {len(result.problems) - 3} more"
                                                   if len(result.problems) > 3 else "")
        raise EngineChoiceError(f"{model_dir} has GLM-5.3-Flash's shape but is not the pinned {lock.pinned}: "
                                f"{listed}. Fix: fetch the pinned revision (glm53 model fetch --out {model_dir}), "
                                f"or see every difference with `glm53 model verify {model_dir}`.")
    return C.quick_check_lines(result, lock, model_dir)
