"""OpenAI-style requests as the tests send them to a gateway or a worker: message and body
builders for the demo model, and one POST for JSON or raw bytes."""

from __future__ import annotations

import httpx

CHAT = "/v1/chat/completions"


def bearer(token: str) -> dict[str, str]:
    """The header that carries an API key or the worker token."""
    return {"authorization": f"Bearer {token}"}


def user(content: str | list[dict]) -> list[dict]:
    """The messages of a one-message conversation: a text or a list of content parts."""
    return [{"role": "user", "content": content}]


def image_message(
    *urls: str, text: str = "describe", uuid: str | None = None, kind: str = "image_url"
) -> dict:
    """A user message: one image part (of type `kind`, with `uuid` if given) per URL, then
    `text`."""
    parts = [{"type": kind, "image_url": {"url": u}} for u in urls]
    if uuid is not None:
        parts = [{**p, "uuid": uuid} for p in parts]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def chat_body(messages: list[dict], **fields: object) -> dict:
    """A chat completion body for the demo model, exactly `fields` besides (no defaults)."""
    return {"model": "demo", "messages": messages, **fields}


def post(
    url: str,
    body: dict | bytes,
    path: str = CHAT,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> httpx.Response:
    """POST `body` to `url` + `path`: a dict as httpx encodes JSON, bytes as they are (with a
    JSON content type, so a malformed body is judged as JSON)."""
    if isinstance(body, bytes):
        headers = {"content-type": "application/json", **(headers or {})}
        return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=timeout)
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=timeout)


def chat(
    url: str,
    messages: list[dict],
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
    max_tokens: int = 2,
    **fields: object,
) -> httpx.Response:
    """A chat completion through `url` (a gateway or a worker), short unless `max_tokens`."""
    return post(url, chat_body(messages, max_tokens=max_tokens, **fields), CHAT, headers, timeout)
