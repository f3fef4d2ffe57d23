"""Admission checks: a malformed prompt fails its own request, never the engine step."""

from __future__ import annotations

from cachekey import Prompt
from cachekey.assets import ImageConfig
from cachekey.errors import RenderError, UnsupportedContentError


def check_prompt(prompt: Prompt, image: ImageConfig | None, vocab_size: int) -> None:
    ids = prompt.token_ids
    if not ids:
        raise RenderError("the prompt is empty", param="prompt")
    placeholder = image.image_token_id if image is not None else None
    if prompt.mm_items and image is None:
        raise UnsupportedContentError("this model does not accept images", param="messages")
    prev_end = 0
    for item in prompt.mm_items:
        if item.modality != "image":
            raise UnsupportedContentError(f"unsupported modality {item.modality!r}")
        if item.offset < prev_end or item.end > len(ids) or item.length <= 0:
            raise RenderError(f"image span {item.offset}+{item.length} is out of order or range")
        assert image is not None
        if item.length != image.tokens_per_image:
            raise RenderError(
                f"image span of {item.length} tokens; this model takes {image.tokens_per_image}"
            )
        if any(t != placeholder for t in ids[item.offset : item.end]):
            raise RenderError("an image span must hold only image placeholder tokens")
        prev_end = item.end
    if min(ids) < 0 or max(ids) >= vocab_size:
        inside = {p for item in prompt.mm_items for p in range(item.offset, item.end)}
        for pos, token in enumerate(ids):
            if (token < 0 or token >= vocab_size) and pos not in inside:
                raise RenderError(f"token id {token} is outside the vocabulary", param="prompt")
    if placeholder is not None:
        count = sum(1 for t in ids if t == placeholder)
        if count != sum(item.length for item in prompt.mm_items):
            raise RenderError(
                "image placeholder tokens without an image (or an image without placeholders)"
            )
