"""The /v1/embeddings request's own fields and rules, which the gateway and the worker share.

OpenAI's `input`, or instead vLLM's chat-style `messages` (for images), never both; never
streamed. Each side's model (gateway/serving/embeddings.py,
worker/server/embedding_protocol.py) adds these to its own base, so both refuse the same bodies
with the same words.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from cachekey.openai.protocol import Bool, Int, OpenAIRequest, Str

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request

# One text, several texts, one prompt as token ids, or several such prompts.
EmbeddingInput = Str | list[Str] | list[Int] | list[list[Int]]


class EmbeddingFields(OpenAIRequest):
    input: EmbeddingInput | None = None
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    add_generation_prompt: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("stream", check_fields=False)  # each side's base has `stream`
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        """True is refused: an embedding has no partial answer to stream."""
        if v:
            raise ValueError("embeddings are not streamed")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> EmbeddingFields:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of `input` and `messages`")
        return self

    def inputs(self) -> list[str | list[int]]:
        """The prompts in `input`, one per output vector (a lone text or token-id list is one);
        none for `messages`."""
        raw = self.input
        if raw is None:
            return []
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            return [raw]
        return list(raw)


def check_count(items: list[str | list[int]]) -> None:
    """At most MAX_INPUTS prompts; counted after `inputs`, so one prompt of many token
    ids is one input."""
    if len(items) > MAX_INPUTS:
        raise ValueError(f"input has {len(items)} items; at most {MAX_INPUTS} are allowed")
