"""Images for GLM-5.3-Flash's vision tower: what a checkpoint's tower takes, and the pixels it takes them as.

Pure functions, shared by the server (token counts, before anything runs) and the engines (the pixels). The
layout is the checkpoint's own and exllamav3's (architecture/glm5_next.py, Glm5NextVisionModel.preprocess): the
image is scaled, keeping its aspect, onto a canvas aligned to patch_size * merge_size whose token count lies in
[min_image_tokens, max_image_tokens] (never upscaled once it meets the minimum), zero-padded to the canvas,
rescaled and normalized, duplicated across the temporal patch, and cut into merge-major patches. In the prompt an
image is `<|begin_of_image|>`, one `<|image|>` per merged patch, then `<|end_of_image|>`; the tower's outputs take
the `<|image|>` positions.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VISUAL_PREFIX = "model.visual."  # the tower's tensors in the checkpoint
EMBEDDINGS_KEPT = 32  # image embeddings an engine keeps by content hash, the latest used (a conversation resends them)


@dataclass(frozen=True)
class VisionSpec:
    """What one checkpoint's vision tower takes (processor_config.json's image_processor, config.json's ids)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_image_tokens: int
    max_image_tokens: int
    image_token_id: int
    image_start_id: int
    image_end_id: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt: its content hash, the prompt positions its embeddings take, and its pixels.

    `start`: the index in the prompt of the first `<|image|>` token; `tokens` of them follow. `pixels`: the
    flattened patches (float32, grid_h * grid_w rows); `grid`: (1, grid_h, grid_w) in patches. `image`: the decoded
    PIL image, for an engine whose tower preprocesses it itself (exllamav3's)."""

    digest: str
    start: int
    tokens: int
    pixels: Any
    grid: tuple[int, int, int]
    image: Any = None

    @property
    def end(self) -> int:
        return self.start + self.tokens


class NoVision(ValueError):
    """The checkpoint has no vision tower: the reason names what is missing."""


def read_vision_spec(model_dir: Path) -> VisionSpec:
    """The vision spec of the checkpoint in `model_dir`; NoVision when its config or weights lack the tower."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
        processor = json.loads((model_dir / "processor_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise NoVision(f"the checkpoint's config.json or processor_config.json cannot be read ({exc})") from None
    ip = processor.get("image_processor") or {}
    try:
        spec = VisionSpec(
            patch_size=int(ip["patch_size"]), merge_size=int(ip["merge_size"]),
            temporal_patch_size=int(ip["temporal_patch_size"]),
            image_mean=tuple(float(v) for v in ip["image_mean"]), image_std=tuple(float(v) for v in ip["image_std"]),
            min_image_tokens=int(ip["min_image_tokens"]), max_image_tokens=int(ip["max_image_tokens"]),
            image_token_id=int(config["image_token_id"]), image_start_id=int(config["image_start_token_id"]),
            image_end_id=int(config["image_end_token_id"]),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise NoVision(f"the checkpoint's vision config lacks {exc}") from None
    if "vision_config" not in config:
        raise NoVision("config.json has no vision_config")
    if not has_visual_weights(model_dir):
        raise NoVision(f"the checkpoint's safetensors hold no vision tower weights ({VISUAL_PREFIX}*)")
    return spec


def has_visual_weights(model_dir: Path) -> bool:
    """Whether any *.safetensors file in `model_dir` holds a tensor of the vision tower (headers only)."""
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if any(k.startswith(VISUAL_PREFIX) for k in f.keys()):
                return True
    return False


def canvas(height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """The aligned canvas (height, width) for an image of `height` x `width` within the token budget."""
    tps, factor = spec.temporal_patch_size, spec.factor
    per_token = tps * factor**2
    min_pixels, max_pixels = spec.min_image_tokens * per_token, spec.max_image_tokens * per_token

    def align(value: float) -> int:
        return math.ceil(value / factor) * factor

    h, w = align(height), align(width)
    if tps * h * w < min_pixels:
        scale = math.sqrt(min_pixels / (tps * height * width))
        h, w = align(max(1, math.ceil(height * scale))), align(max(1, math.ceil(width * scale)))
    if tps * h * w > max_pixels:
        h, w = _fit_budget(height, width, tps, factor, max_pixels)
    return h, w


def _fit_budget(height: int, width: int, tps: int, factor: int, max_pixels: int) -> tuple[int, int]:
    """The largest aspect-keeping aligned canvas within max_pixels (a binary search over the content height)."""
    low, high = 1, height
    best = (factor, factor)
    while low <= high:
        ch = (low + high) // 2
        cw = max(1, math.floor(width * ch / height))
        cand = (math.ceil(ch / factor) * factor, math.ceil(cw / factor) * factor)
        if tps * cand[0] * cand[1] <= max_pixels:
            best, low = cand, ch + 1
        else:
            high = ch - 1
    return best


def content_size(height: int, width: int, target: tuple[int, int], spec: VisionSpec) -> tuple[int, int]:
    """The (height, width) the image is scaled to on its canvas: aspect kept, no upscaling past the minimum."""
    th, tw = target
    scale = min(th / height, tw / width)
    if height * width >= spec.factor**2 * spec.min_image_tokens:
        scale = min(1.0, scale)
    return max(1, min(th, math.floor(height * scale))), max(1, min(tw, math.floor(width * scale)))


def image_tokens(height: int, width: int, spec: VisionSpec) -> int:
    """Prompt tokens (`<|image|>` positions) of an image of this size."""
    th, tw = canvas(height, width, spec)
    return (th // spec.patch_size) * (tw // spec.patch_size) // spec.merge_size**2


def pixels(image: Any, spec: VisionSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """A decoded PIL image -> (flattened patches, float32; grid (1, grid_h, grid_w)) in the tower's layout."""
    from PIL import Image

    rgb = image.convert("RGB")
    w, h = rgb.size
    th, tw = canvas(h, w, spec)
    ch, cw = content_size(h, w, (th, tw), spec)
    if (cw, ch) != (w, h):
        rgb = rgb.resize((cw, ch), resample=Image.Resampling.BICUBIC)
    board = Image.new("RGB", (tw, th), (0, 0, 0))
    board.paste(rgb, (0, 0))
    arr = np.asarray(board, dtype=np.float32) / 255.0
    arr = (arr - np.asarray(spec.image_mean, np.float32)) / np.asarray(spec.image_std, np.float32)
    return _patchify(arr.transpose(2, 0, 1), spec), (1, th // spec.patch_size, tw // spec.patch_size)


def _patchify(chw: np.ndarray, spec: VisionSpec) -> np.ndarray:
    """(C, H, W) -> (grid_h * grid_w, C * tps * p * p), merge-major, the one frame repeated across tps."""
    c, h, w = chw.shape
    p, m, tps = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = h // p, w // p
    x = chw.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tps, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, c * tps * p * p))


def content_hash(data: bytes) -> str:
    """The identity of an image: the same bytes are the same image (its embedding and the prefixes holding it)."""
    return hashlib.sha256(data).hexdigest()
