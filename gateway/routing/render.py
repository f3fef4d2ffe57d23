"""A request's prompt and block keys, as its worker will render and key it."""

from __future__ import annotations

from cachekey.keys import HashNamespace, block_keys
from cachekey.render import ImageOptions
from cachekey.types import Prompt
from gateway.protocol import ChatCompletionRequest, CompletionRequest

PromptRequest = ChatCompletionRequest | CompletionRequest  # what render_request renders

# A text-only request up to this many characters (or token ids) renders on the event loop: it
# costs less than the hop to a render thread and back (docs/benchmarks.md, Gateway overhead).
INLINE_RENDER_CHARS = 4096


def render_request(
    renderer,
    req: PromptRequest,
    ns: HashNamespace,
    images: ImageOptions,
    lora_name: str | None = None,
) -> tuple[Prompt, list]:
    """Prompt and block keys of a request (runs in the render thread pool); a LoRA adapter's
    name is in every block key, as the worker keys it."""
    if isinstance(req, ChatCompletionRequest):
        prompt = renderer.render_chat(
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs,
            images=images,
        )
    else:
        p = req.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            p = p[0]  # a batch is routed by its first prompt
        prompt = renderer.render_completion(p)
    return prompt, block_keys(prompt.token_ids, ns, prompt.mm_items, lora_name, req.cache_salt)


def is_small_text(req: PromptRequest) -> bool:
    """Text only (no images, no tools) and at most INLINE_RENDER_CHARS characters in all."""
    budget = INLINE_RENDER_CHARS
    if isinstance(req, CompletionRequest):
        p = req.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            p = p[0]
        return len(p) <= budget
    if req.tools:
        return False
    for msg in req.messages:
        content = msg.get("content")
        if isinstance(content, str):
            budget -= len(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    return False
                text = part.get("text")
                budget -= len(text) if isinstance(text, str) else 0
        if budget < 0:
            return False
    return True
