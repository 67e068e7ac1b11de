"""The checkpoint's vision tower under exllamav3: its own component model, preprocessing and embeddings.

exllamav3 1.6.5 builds the tower with `Model.from_config(config, component="vision")` (Glm5NextVisionModel) and
makes an image's embeddings with `get_image_embeddings(tokenizer, image)`: its own canvas, normalization and
patch layout, then the tower, returning an MMEmbedding. The embedding owns a run of placeholder token ids
(>= 10^9, allocated once per MMEmbedding) that stand in the prompt for the image; its `token_list` is
`[begin_of_image, ids..., end_of_image]`, and a Job given the embedding reads its rows at those ids.

exllamav3's page cache hashes token ids, so a prompt holding an embedding's ids reuses only pages that held the
same embedding: embeddings are kept by the image's content hash (sha256), so a conversation that resends an image
gets the same ids and its cached prefix, and another image (other ids) can never match those pages.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("glm53.engine")


class VisionTower:
    """The loaded tower and the embeddings it made, the latest `kept` by content hash."""

    def __init__(self, model: Any, tokenizer: Any, kept: int) -> None:
        self.model, self.tokenizer, self.kept = model, tokenizer, max(1, kept)
        self._embeddings: OrderedDict[str, Any] = OrderedDict()  # content hash -> MMEmbedding
        self.counts = {"images_encoded": 0, "image_embeddings_reused": 0}

    @classmethod
    def load(cls, exl: Any, config: Any, tokenizer: Any, device: str, kept: int) -> VisionTower:
        """The tower's weights onto `device` (after the text model: the plan counts it inside the same budget)."""
        import torch

        model = exl.Model.from_config(config, component="vision")
        model.load(device=torch.device(device))
        return cls(model, tokenizer, kept)

    def warm(self) -> None:
        """One small image through the tower before serving, so the first request does not compile its kernels."""
        from PIL import Image

        self.model.get_image_embeddings(self.tokenizer, Image.new("RGB", (64, 64), (127, 127, 127)))

    def embedding(self, digest: str, image: Any) -> Any:
        """The MMEmbedding of one image (a PIL image whose bytes hash to `digest`), made once and kept."""
        mme = self._embeddings.get(digest)
        if mme is not None:
            self._embeddings.move_to_end(digest)
            self.counts["image_embeddings_reused"] += 1
            return mme
        mme = self.model.get_image_embeddings(self.tokenizer, image)
        self._embeddings[digest] = mme
        self.counts["images_encoded"] += 1
        while len(self._embeddings) > self.kept:
            self._embeddings.popitem(last=False)
        return mme

    def prompt(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], list[Any]]:
        """`ids` with each image's span of image tokens replaced by its embedding's placeholder ids, and the
        embeddings the job takes. An image is anything with digest, image (PIL), start and tokens."""
        out, used = list(ids), []
        for im in images:
            mme = self.embedding(im.digest, im.image)
            if int(mme.mm_length) != im.tokens:
                raise ValueError(f"exllamav3's tower made {mme.mm_length} embeddings for an image laid out as "
                                 f"{im.tokens} tokens: glm53.engine.vision and exllamav3 disagree on its canvas")
            out[im.start:im.start + im.tokens] = mme.token_list[1:-1]
            if all(mme is not u for u in used):
                used.append(mme)
        return out, used

    def stats(self) -> dict:
        return {**self.counts, "image_embeddings_kept": len(self._embeddings)}

    def close(self) -> None:
        self._embeddings.clear()
        self.model.unload()
