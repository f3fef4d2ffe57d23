"""Forwarded image parts: each gets its identifier as `uuid`, and a fetched remote image inline.

The worker then keys every image exactly as the gateway did, and never fetches a URL itself.
"""

from __future__ import annotations

import base64
from typing import Any

from cachekey.render import IMAGE_PART_TYPES
from cachekey.types import Prompt

_IMAGE_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"))


def _mime(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((m for magic, m in _IMAGE_MAGIC if data.startswith(magic)), "image/png")


def _image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The image content parts (of every image part type) in the order the renderer walks them."""
    parts = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            parts += [
                p for p in content if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
            ]
    return parts


def pin_images(messages: list[dict[str, Any]], prompt: Prompt) -> None:
    """Give every image part its identifier as `uuid`; inline fetched remote images."""
    if not prompt.mm_items:
        return
    parts = _image_parts(messages)
    if len(parts) != len(prompt.mm_items):
        return
    for part, item in zip(parts, prompt.mm_items, strict=True):
        # Both part types carry the image under "image_url" (a string or {"url": ...}).
        image = part.get("image_url")
        url = image.get("url", "") if isinstance(image, dict) else image or ""
        if url.startswith(("http://", "https://")) and item.identifier in prompt.mm_data:
            data = prompt.mm_data[item.identifier]
            inline = f"data:{_mime(data)};base64,{base64.b64encode(data).decode()}"
            part["image_url"] = {**image, "url": inline} if isinstance(image, dict) else inline
        part["uuid"] = item.identifier
