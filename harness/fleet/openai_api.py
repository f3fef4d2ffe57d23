"""The OpenAI requests a fleet replica takes (chat and completions), and its answers' bodies.

The fields that decide what is cached and for how long: `messages` or `prompt` (rendered with
the model's template, as the worker renders them), `max_tokens` / `max_completion_tokens`,
`cache_salt`, `stream` and `stream_options.include_usage`. Other fields are accepted and ignored:
the answer's text is a stand-in, its length and its usage are exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from cachekey.errors import RenderError
from cachekey.openai.sse import sse_event
from cachekey.types import Prompt
from harness.fleet.model import FleetModel

_json = msgspec.json.Encoder()
DEFAULT_MAX_TOKENS = 16


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(slots=True)
class SimRequest:
    chat: bool
    prompt: Prompt
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None


def parse_request(model: FleetModel, body: bytes, chat: bool) -> SimRequest:
    """The request, rendered; BadRequest with the status and the field at fault otherwise."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise BadRequest(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(400, "the request body must be a JSON object")
    name = data.get("model")
    if name is not None and name != model.name:
        raise BadRequest(404, f"The model `{name}` does not exist", "model")
    max_tokens = data.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = data.get("max_tokens", DEFAULT_MAX_TOKENS)
    if type(max_tokens) is not int or max_tokens < 1:
        raise BadRequest(400, "max_tokens must be a positive integer", "max_tokens")
    salt = data.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest(400, "cache_salt must be a non-empty string", "cache_salt")
    options = data.get("stream_options") or {}
    try:
        prompt = _render(model, data, chat)
    except RenderError as e:
        raise BadRequest(e.status_code, e.message, e.param) from None
    if len(prompt) + max_tokens > model.renderer.max_model_len:
        raise BadRequest(
            400,
            f"This model's maximum context length is {model.renderer.max_model_len} tokens; "
            f"{len(prompt)} prompt tokens and max_tokens {max_tokens} exceed it",
            "max_tokens",
        )
    return SimRequest(
        chat=chat,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=data.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        cache_salt=salt,
    )


def _render(model: FleetModel, data: dict[str, Any], chat: bool) -> Prompt:
    r = model.renderer
    if not chat:
        return r.render_completion(data.get("prompt"))
    return r.render_chat(
        data.get("messages"),
        add_generation_prompt=data.get("add_generation_prompt", True) is not False,
        tools=data.get("tools"),
        chat_template_kwargs=data.get("chat_template_kwargs"),
    )


def _text(n: int) -> str:
    return " ".join(["sim"] * n)


def usage(req: SimRequest, cached: int) -> dict[str, Any]:
    n = len(req.prompt)
    return {
        "prompt_tokens": n,
        "completion_tokens": req.max_tokens,
        "total_tokens": n + req.max_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def answer(rid: str, model: str, req: SimRequest, cached: int) -> bytes:
    """The whole (non-streamed) answer."""
    text = _text(req.max_tokens)
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    choice["finish_reason"] = "length"
    return _json.encode(
        {
            "id": rid,
            "object": "chat.completion" if req.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage(req, cached),
        }
    )


def chunk(rid: str, model: str, req: SimRequest, tokens: int, finish: bool) -> bytes:
    """One SSE event carrying `tokens` tokens of text (the last one with its finish reason)."""
    text = _text(tokens)
    if req.chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
    else:
        choice = {"index": 0, "text": text}
    choice["finish_reason"] = "length" if finish else None
    return _event(rid, model, req, [choice])


def usage_chunk(rid: str, model: str, req: SimRequest, cached: int) -> bytes:
    return _event(rid, model, req, [], usage(req, cached))


def _event(rid: str, model: str, req: SimRequest, choices: list, use: dict | None = None) -> bytes:
    body = {
        "id": rid,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        body["usage"] = use
    return sse_event(_json.encode(body))
