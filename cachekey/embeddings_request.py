"""The rules of an OpenAI /v1/embeddings request that the gateway and the worker both apply.

Plain functions, not a pydantic model: pydantic is not a cachekey dependency (pyproject.toml),
and each side's model keeps its own base (gateway/embeddings.py, worker/server/
embedding_protocol.py). Their validators call these, so both refuse the same bodies with the
same words; a ValueError here becomes a 400 on either side.
"""

from __future__ import annotations

from typing import Any

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request

# One text, several texts, one prompt as token ids, or several such prompts.
EmbeddingInput = str | list[str] | list[int] | list[list[int]]


def not_streamed(stream: bool) -> bool:
    """`stream` unchanged; true is refused, as an embedding has no partial answer to stream."""
    if stream:
        raise ValueError("embeddings are not streamed")
    return stream


def check_one_source(input: EmbeddingInput | None, messages: list[dict[str, Any]] | None) -> None:
    """`input` (kvgate also takes vLLM's chat-style `messages`, for images), never both."""
    if (input is None) == (messages is None):
        raise ValueError("give exactly one of `input` and `messages`")


def split_inputs(raw: EmbeddingInput) -> list[str | list[int]]:
    """The prompts in `input`, one per output vector: a lone text or token-id list is one."""
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        return [raw]
    return list(raw)


def check_count(items: list[str | list[int]]) -> None:
    """At most MAX_INPUTS prompts; counted after `split_inputs`, so one prompt of many token
    ids is one input."""
    if len(items) > MAX_INPUTS:
        raise ValueError(f"input has {len(items)} items; at most {MAX_INPUTS} are allowed")
