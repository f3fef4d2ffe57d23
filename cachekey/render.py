"""Render an OpenAI request into a Prompt: token ids with image placeholders expanded, plus spans.

This runs on the gateway for every request: the template is compiled once per model, the text is
tokenized through a per-segment cache (segment_encoder), and images are hashed and probed from
their header only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from cachekey.assets import ModelAssets
from cachekey.errors import (
    ImageFetchError,
    ImageTooLargeError,
    InvalidImageError,
    RenderError,
    TooManyImagesError,
    UnsupportedContentError,
    context_exceeded,
    context_exceeded_by_length,
)
from cachekey.images import VERBATIM_UUIDS, ClientUuids, decode_data_url, probe_image
from cachekey.segment_encoder import SegmentEncoder
from cachekey.template import RESERVED_NAMES, render_template
from cachekey.token_bound import chars_per_token_bound, min_tokens
from cachekey.types import MMItem, Prompt

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})


def count_images(messages: Any) -> int:
    """The image parts in a chat request's `messages`; parts of any other shape are counted
    nowhere (the renderer refuses them by name)."""
    if not isinstance(messages, list):
        return 0
    return sum(
        1
        for msg in messages
        if isinstance(msg, dict) and isinstance(msg.get("content"), list)
        for part in msg["content"]
        if isinstance(part, dict) and _is_image(part.get("type"))
    )


def _is_image(kind: Any) -> bool:
    return isinstance(kind, str) and kind in IMAGE_PART_TYPES  # a list's type is unhashable


@dataclass(frozen=True, slots=True)
class RenderLimits:
    max_model_len: int | None = None  # lowers the model's own limit, never raises it
    max_images: int = 32
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 4096 * 4096
    segment_cache_entries: int = 4096
    segment_cache_chars: int = 64 * 2**20

    def __post_init__(self) -> None:
        for name in ("max_images", "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RenderLimits.{name} must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("RenderLimits.max_model_len must be positive")
        if self.segment_cache_entries < 0 or self.segment_cache_chars < 0:
            raise ValueError("RenderLimits segment cache sizes must not be negative")


@dataclass(frozen=True, slots=True)
class ImageOptions:
    """Per-request image handling (the gateway makes one per request).

    `fetch`: the fetcher for this request's http(s) URLs (e.g. bound to the request's time and
    byte budget); None uses the Renderer's own. `uuids`: what a client's `uuid` means.
    """

    fetch: Callable[[str], bytes] | None = None
    uuids: ClientUuids = VERBATIM_UUIDS


@dataclass(frozen=True, slots=True)
class _Image:
    identifier: str
    data: bytes
    param: str  # the content part it came from


@dataclass(slots=True)
class _Call:
    """What one render_chat call collects and uses while it walks the messages."""

    fetch: Callable[[str], bytes] | None
    uuids: ClientUuids
    images: list[_Image]


class Renderer:
    """Request -> Prompt for one model's assets; safe to share across threads."""

    def __init__(
        self,
        assets: ModelAssets,
        fetcher: Callable[[str], bytes] | None = None,
        limits: RenderLimits = RenderLimits(),
    ) -> None:
        self.assets, self.fetcher, self.limits = assets, fetcher, limits
        tok = assets.tokenizer
        self._encoder = SegmentEncoder(
            tok, limits.segment_cache_entries, limits.segment_cache_chars
        )
        self.max_model_len = min(assets.max_model_len, limits.max_model_len or assets.max_model_len)
        self._vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._affixes = _special_affixes(tok)
        # A text longer than this many characters is proven past the context (token_bound.py).
        bound = chars_per_token_bound(tok)
        self._max_chars = None if bound is None else bound * self.max_model_len

    # ---- public API -------------------------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        images: ImageOptions = ImageOptions(),
    ) -> Prompt:
        template = self.assets.compiled_template()
        if template is None:
            raise UnsupportedContentError(
                "this model has no chat template; use /v1/completions", param="messages"
            )
        if not isinstance(messages, list) or not messages:
            raise UnsupportedContentError("messages must be a non-empty list", param="messages")
        kwargs = chat_template_kwargs or {}
        if not isinstance(kwargs, dict) or RESERVED_NAMES & kwargs.keys():
            raise UnsupportedContentError(
                f"chat_template_kwargs must be an object without {sorted(RESERVED_NAMES)}",
                param="chat_template_kwargs",
            )
        if (count := count_images(messages)) > self.limits.max_images:
            raise TooManyImagesError(count, self.limits.max_images)
        call = _Call(images.fetch or self.fetcher, images.uuids, [])
        normalized = [self._message(i, m, call) for i, m in enumerate(messages)]
        text = render_template(
            template,
            normalized,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.assets.bos_token,
            eos_token=self.assets.eos_token,
            tools=tools,
            extra=kwargs,
        )
        self._check_length(text, "messages")
        return self._expand(self._encoder.encode(text), call.images, "messages")

    def render_completion(self, prompt: str | list[int], field: str = "prompt") -> Prompt:
        """A completion's prompt; `field` is the request field it came from, named in errors
        (`input` for an embeddings input)."""
        if isinstance(prompt, str):
            self._check_length(prompt, field)
            if self._affixes is None:
                ids = self.assets.tokenizer.encode(prompt).ids
            else:
                ids = self._affixes[0] + self._encoder.encode(prompt) + self._affixes[1]
        elif isinstance(prompt, list):
            ids = self._checked_ids(prompt, field)
        else:
            raise UnsupportedContentError(
                f"{field} must be a string or a list of token ids", param=field
            )
        if not ids:
            raise UnsupportedContentError(f"{field} is empty", param=field)
        return self._expand(ids, [], field)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.assets.tokenizer.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens
        )

    # ---- internals --------------------------------------------------------------------------

    def _check_length(self, text: str, where: str) -> None:
        """Refuse a text its length alone proves past the context, before tokenizing it."""
        if self._max_chars is not None and len(text) > self._max_chars:
            at_least = min_tokens(len(text), self._max_chars // self.max_model_len)
            raise context_exceeded_by_length(self.max_model_len, at_least, len(text), where)

    def _checked_ids(self, prompt: list[Any], field: str) -> list[int]:
        for i, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self._vocab_size:
                raise UnsupportedContentError(
                    f"{field}[{i}] = {t!r} is not a token id in [0, {self._vocab_size})",
                    param=field,
                )
        return list(prompt)

    def _message(self, i: int, msg: Any, call: _Call) -> dict[str, Any]:
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise UnsupportedContentError(f"{where} must be an object", param=where)
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise UnsupportedContentError(
                f"{where}.role {role!r} is not one of {sorted(ROLES)}", param=f"{where}.role"
            )
        content = msg.get("content")
        if isinstance(content, str):
            return msg
        if content is None:
            if role == "assistant":
                return msg
            raise UnsupportedContentError(f"{where}.content is required", param=f"{where}.content")
        if not isinstance(content, list):
            raise UnsupportedContentError(
                f"{where}.content must be a string or a list of content parts",
                param=f"{where}.content",
            )
        parts = [self._part(f"{where}.content[{j}]", p, call) for j, p in enumerate(content)]
        if self.assets.image is None:
            # Text-only templates expect a string, as vLLM passes for "string"-format templates.
            return {**msg, "content": "\n".join(p["text"] for p in parts)}
        return {**msg, "content": parts}

    def _part(self, where: str, part: Any, call: _Call) -> dict[str, Any]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise UnsupportedContentError(f"{where}.text must be a string", param=where)
            return {"type": "text", "text": part["text"]}
        if not _is_image(kind):
            raise UnsupportedContentError(
                f"{where}: content part type {kind!r} is not supported; use 'text', 'image_url'"
                " or 'input_image'",
                param=f"{where}.type",
            )
        if self.assets.image is None:
            raise UnsupportedContentError("this model does not accept images", param=where)
        ref = part.get(kind) if kind == "image_url" else part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise UnsupportedContentError(
                f"{where}.image_url.url must be a non-empty string: a data: URL or an http(s) URL",
                param=where,
            )
        uuid = part.get("uuid")
        if uuid is not None and (not isinstance(uuid, str) or not uuid):
            raise UnsupportedContentError(f"{where}.uuid must be a non-empty string", param=where)
        data = self._image_bytes(url, where, call.fetch)
        probe_image(data, self.limits.max_image_pixels, param=where)
        call.images.append(_Image(call.uuids.identifier(uuid, data), data, where))
        return {"type": "image"}

    def _image_bytes(self, url: str, where: str, fetch: Callable[[str], bytes] | None) -> bytes:
        if url.startswith("data:"):
            return decode_data_url(url, self.limits.max_image_bytes, param=where)
        if not url.startswith(("http://", "https://")):
            raise InvalidImageError("image URL must be a data: URL or an http(s) URL", param=where)
        if fetch is None:
            raise ImageFetchError(
                "remote image URLs are disabled; send the image as a data: URL", param=where
            )
        try:
            data = fetch(url)
        except RenderError as e:
            e.param = e.param or where  # the fetcher knows the URL, not the part it came from
            raise
        except Exception as e:
            raise ImageFetchError(f"could not fetch the image: {e}", param=where) from e
        if len(data) > self.limits.max_image_bytes:
            raise ImageTooLargeError(
                f"image is larger than the limit of {self.limits.max_image_bytes} bytes",
                param=where,
            )
        return data

    def _expand(self, ids: list[int], images: list[_Image], param: str) -> Prompt:
        """Replace each image token with the model's placeholder run and record its span."""
        image = self.assets.image
        found = ids.count(image.image_token_id) if image is not None else 0
        if found != len(images):
            raise UnsupportedContentError(
                f"the prompt has {found} image placeholder(s) {image.image_token!r} but the "
                f"request carries {len(images)} image(s); do not type the placeholder as text",
                param=param,
            )
        out: list[int] = ids
        items: list[MMItem] = []
        if images:
            tid, n = image.image_token_id, image.tokens_per_image
            out, start = [], 0
            for img in images:
                pos = ids.index(tid, start)
                out.extend(ids[start:pos])
                items.append(MMItem(img.identifier, "image", len(out), n))
                out.extend([tid] * n)
                start = pos + 1
            out.extend(ids[start:])
        if len(out) > self.max_model_len:
            raise context_exceeded(self.max_model_len, len(out), param, param=param)
        data = {img.identifier: img.data for img in images}
        params = {img.identifier: img.param for img in reversed(images)}  # the first part wins
        return Prompt(tuple(out), tuple(items), data, params)


def _special_affixes(tok: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor adds around a single sequence (e.g. BOS), or None if unclear."""
    bare = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return full[:i], full[i + len(bare) :]
    return None
