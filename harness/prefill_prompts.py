"""Prompts that share a prefix, for the engine-level benchmarks (`bench.hidden_prefill`): token
prompts whose first `shared` share is the same, and chat prompts with four images in the part
they share, rendered by the model's own renderer."""

from __future__ import annotations

import random

from cachekey import Prompt
from cachekey.render import Renderer
from harness.workload import data_url, make_image

WORDS = "cache block prefix route model token image worker gateway replica tenant layer".split()


def text_prompts(n: int, tokens: int, shared: float, rng: random.Random) -> list[Prompt]:
    """`n` prompts of `tokens` random token ids, the first `shared` share of them the same."""
    prefix = [rng.randrange(100, 1900) for _ in range(int(tokens * shared))]
    tail = tokens - len(prefix)
    return [
        Prompt(tuple(prefix + [rng.randrange(100, 1900) for _ in range(tail)])) for _ in range(n)
    ]


def image_prompts(
    renderer: Renderer, n: int, tokens: int, shared: float, rng: random.Random
) -> list[Prompt]:
    """Chat prompts: text and four images in the shared part, then a text tail of its own."""

    def words(count: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(count))

    def render(parts: list[dict]) -> Prompt:
        return renderer.render_chat([{"role": "user", "content": parts}])

    images = [data_url(make_image(7_000 + i)) for i in range(4)]
    shared_parts: list[dict] = []
    for url in images:
        shared_parts.append({"type": "text", "text": words(20)})
        shared_parts.append({"type": "image_url", "image_url": {"url": url}})
    while len(render(shared_parts)) < tokens * shared:
        shared_parts.append({"type": "text", "text": words(40)})
    prompts = []
    for _ in range(n):
        tail = [{"type": "text", "text": words(10)}]
        while len(render(shared_parts + tail)) < tokens:
            tail[0]["text"] += " " + words(10)
        prompts.append(render(shared_parts + tail))
    return prompts
