"""Images in requests: where their bytes come from, what is refused, and their place in the prompt.

Every API's image (an OpenAI `image_url` part, an Anthropic `image` block, a Responses `input_image`) reaches the
chat route as an `image_url` part holding a data URL or an http(s) URL. Here it is read (URLs only where
GLM53_IMAGE_URL_FETCH allows: the appliance runs offline), checked against the limits, decoded with Pillow and
laid out as the vision tower takes it (glm53.engine.vision). In the rendered prompt each image stands as one
marker (`<|begin_of_image|><|image|><|end_of_image|>`, whatever the chat template does with images); after
tokenizing, each marker's single `<|image|>` becomes as many as the image has tokens.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import re
import urllib.request
from dataclasses import dataclass
from typing import Any

from glm53.engine.vision import PromptImage, VisionSpec, content_hash, pixels
from glm53.server.errors import APIError, bad_request

log = logging.getLogger("glm53.server")

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}
MAX_PIXELS = 64 * 1024 * 1024  # a larger canvas is a decompression bomb, whatever its file size
FETCH_TIMEOUT_S = 10.0
MARKER = "<|begin_of_image|><|image|><|end_of_image|>"
_BASE64_RUN = re.compile(rb"[A-Za-z0-9+/=]{1024,}")  # inline image data, as a request body carries it


@dataclass(frozen=True)
class ImageLimits:
    max_images: int
    max_bytes: int
    fetch: bool

    @classmethod
    def of(cls, settings: Any) -> ImageLimits:
        return cls(max_images=int(getattr(settings, "max_images", 16)),
                   max_bytes=int(float(getattr(settings, "max_image_mb", 5.0)) * (1 << 20)),
                   fetch=bool(getattr(settings, "image_url_fetch", False)))


@dataclass(frozen=True)
class ImageRef:
    """An image part as sent: its URL (data: or http(s)), the request field it came in, and the index of its
    message among the template's messages."""

    url: str
    param: str
    message: int


@dataclass(frozen=True)
class DecodedImage:
    digest: str
    image: Any  # a loaded PIL image


def inline_image_bytes(body: bytes) -> int:
    """Bytes of a request body that are long base64 runs (inline images: data URLs, Anthropic base64 sources)."""
    return sum(m.end() - m.start() for m in _BASE64_RUN.finditer(body))


def unavailable(engine: Any, param: str) -> APIError:
    reason = getattr(engine, "no_vision_reason", "this engine does not run the vision tower")
    return bad_request(f"This server cannot read images: {reason}.", param=param, code="images_unsupported")


def check_count(refs: list[ImageRef], limits: ImageLimits) -> None:
    if len(refs) > limits.max_images:
        raise bad_request(f"The request carries {len(refs)} images, history included, and this server takes at most "
                          f"{limits.max_images} (GLM53_MAX_IMAGES): drop older images from the conversation, or "
                          "raise that setting.", param=refs[limits.max_images].param, code="too_many_images")


def read_bytes(ref: ImageRef, limits: ImageLimits) -> tuple[str | None, bytes]:
    """(declared media type, encoded bytes) of an image reference."""
    url = ref.url.strip()
    if url[:5].lower() == "data:":
        return _data_url(url, ref.param, limits)
    if url[:7].lower() == "http://" or url[:8].lower() == "https://":
        if not limits.fetch:
            raise bad_request(f"{ref.param}: images by URL are not fetched by this server (it runs offline): send "
                              "the image's bytes inline (a base64 data URL, or an Anthropic base64 source), or start "
                              "the server with GLM53_IMAGE_URL_FETCH=1.", param=ref.param, code="image_url_not_allowed")
        return _fetch(url, ref.param, limits)
    raise bad_request(f"{ref.param}: an image URL must be a data: URL (data:image/png;base64,...) or http(s); "
                      f"got {url[:30]!r}.", param=ref.param, code="invalid_image_url")


def _data_url(url: str, param: str, limits: ImageLimits) -> tuple[str | None, bytes]:
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise bad_request(f"{param}: a data URL must be base64 (data:image/png;base64,...).", param=param,
                          code="invalid_image_url")
    media = head[5:-7].strip().lower() or None
    _check_media(media, param)
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise _too_large(len(payload) * 3 // 4, param, limits)
    return media, decode_base64(payload, param)


def decode_base64(payload: str, param: str) -> bytes:
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: the image data is not valid base64.", param=param,
                          code="invalid_image") from None


def _fetch(url: str, param: str, limits: ImageLimits) -> tuple[str | None, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as resp:  # noqa: S310 - http(s) checked above
            media = (resp.headers.get_content_type() or "").lower() or None
            data = resp.read(limits.max_bytes + 1)
    except OSError as exc:
        raise bad_request(f"{param}: the image at {url} could not be fetched ({exc}): send its bytes inline.",
                          param=param, code="image_fetch_failed") from None
    if len(data) > limits.max_bytes:
        raise _too_large(len(data), param, limits, at_least=True)
    return media, data


def _check_media(media: str | None, param: str) -> None:
    if media is not None and media not in MEDIA_TYPES:
        raise bad_request(f"{param}: image media type {media!r} is not supported: send PNG, JPEG, GIF or WebP "
                          f"({', '.join(MEDIA_TYPES)}).", param=param, code="unsupported_media_type")


def _too_large(size: int, param: str, limits: ImageLimits, at_least: bool = False) -> APIError:
    more = "more than " if at_least else ""
    return APIError(413, f"{param}: the image has {more}{size} bytes, more than the {limits.max_bytes} this server "
                         "takes (GLM53_MAX_IMAGE_MB): send it smaller (a screenshot scaled down, or as JPEG).",
                    param=param, code="image_too_large")


def decode(ref: ImageRef, media: str | None, data: bytes, limits: ImageLimits) -> DecodedImage:
    """The checked, loaded image; 400/413 naming what is wrong with it."""
    from PIL import Image, UnidentifiedImageError

    _check_media(media, ref.param)
    if len(data) > limits.max_bytes:
        raise _too_large(len(data), ref.param, limits)
    try:
        image = Image.open(io.BytesIO(data), formats=list(MEDIA_TYPES.values()))
        width, height = image.size
        if width * height > MAX_PIXELS:
            raise APIError(413, f"{ref.param}: the image is {width} x {height} pixels, more than the {MAX_PIXELS} "
                                "this server decodes: send it scaled down.", param=ref.param, code="image_too_large")
        image.load()
    except APIError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        why = "its bytes are no image file" if isinstance(exc, UnidentifiedImageError) else str(exc)
        raise bad_request(f"{ref.param}: the image cannot be decoded as PNG, JPEG, GIF or WebP ({why}): send the "
                          "file's bytes unchanged.", param=ref.param, code="invalid_image") from None
    if media is not None and MEDIA_TYPES[media] != image.format:
        log.debug("%s: declared %s, decoded as %s", ref.param, media, image.format)
    return DecodedImage(content_hash(data), image)


def load(ref: ImageRef, limits: ImageLimits) -> DecodedImage:
    media, data = read_bytes(ref, limits)
    return decode(ref, media, data, limits)


def expand(ids: list[int], images: list[DecodedImage], spec: VisionSpec, param: str) -> tuple[list[int],
                                                                                             list[PromptImage]]:
    """Prompt ids with each image marker's `<|image|>` widened to the image's tokens, and the images' spans."""
    marker = [spec.image_start_id, spec.image_token_id, spec.image_end_id]
    at = [i for i in range(len(ids) - 2) if ids[i:i + 3] == marker]
    if len(at) != len(images):
        raise bad_request(f"The prompt holds {len(at)} image markers for {len(images)} images: the text must not "
                          f"spell the image tokens ({MARKER}).", param=param, code="invalid_image")
    out: list[int] = []
    placed: list[PromptImage] = []
    last = 0
    for pos, im in zip(at, images, strict=True):
        out.extend(ids[last:pos + 1])
        px, grid = pixels(im.image, spec)
        n = grid[1] * grid[2] // spec.merge_size**2
        placed.append(PromptImage(im.digest, len(out), n, px, grid, im.image))
        out.extend([spec.image_token_id] * n)
        last = pos + 2
    out.extend(ids[last:])
    return out, placed
