"""/v1/embeddings through the gateway: routed by the same block keys as completions.

An embeddings request is a prefill: each input fills and hits the worker's prefix cache exactly
as a completion with the same prompt (the worker computes its last token, as for a completion).
A request with several inputs is ranked by its first input, as a batched completion is, and the
cached tokens predicted on the chosen replica add up every input's match there, which is what
the worker reports in `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pydantic import model_validator

from cachekey.keys import HashNamespace, block_keys, usable_match
from cachekey.openai.embeddings import EmbeddingFields, check_count
from cachekey.openai.errors import INVALID_VALUE, APIError
from cachekey.render import ImageOptions
from cachekey.types import BlockKey, Prompt
from gateway.fleet.replica import Replica
from gateway.images.parts import pin_images
from gateway.protocol import _Request
from gateway.routing.request import ProxyRequest


class EmbeddingRequest(EmbeddingFields, _Request):
    """The rules shared with the worker are in cachekey/openai/embeddings.py."""

    @model_validator(mode="after")
    def _at_most_max_inputs(self) -> EmbeddingRequest:
        check_count(self.inputs())  # before rendering any of them
        return self


Rendered = list[tuple[Prompt, list[BlockKey]]]


def render_embedding(
    renderer,
    req: EmbeddingRequest,
    ns: HashNamespace,
    images: ImageOptions,
    lora_name: str | None = None,
) -> Rendered:
    """Prompt and block keys of every input (runs in the render thread pool); a LoRA adapter's
    name is in every block key, as the worker keys it."""
    if req.messages is not None:
        prompts = [
            renderer.render_chat(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs,
                images=images,
            )
        ]
    else:
        prompts = [renderer.render_completion(p, "input") for p in req.inputs()]
    if not prompts:
        msg = "Invalid value for 'input': input must not be an empty list."  # as the worker says
        raise APIError(400, msg, param="input", code=INVALID_VALUE)
    salt = req.cache_salt
    return [(p, block_keys(p.token_ids, ns, p.mm_items, lora_name, salt)) for p in prompts]


@dataclass(slots=True, eq=False)
class EmbeddingProxyRequest(ProxyRequest):
    rest: Rendered = field(default_factory=list)  # the inputs after the first

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt) + sum(len(p) for p, _ in self.rest)

    async def render(self) -> None:
        st = self.state
        t0 = time.perf_counter()
        renderer, images = await self.render_inputs()
        assert isinstance(self.body, EmbeddingRequest)
        rendered = await st.render_queue.run(
            render_embedding, renderer, self.body, self.ns, images, self.lora_name
        )
        (self.prompt, self.keys), *self.rest = rendered
        st.metrics.render_seconds.observe(time.perf_counter() - t0)

    def payload(self) -> bytes:
        b = self.body
        assert isinstance(b, EmbeddingRequest)
        if b.messages is not None:
            pin_images(b.messages, self.prompt)
        return b.model_dump_json(exclude_unset=True).encode()

    def predicted_for(self, rep: Replica) -> int:
        first = ProxyRequest.predicted_for(self, rep)
        if not self.rest or not rep.parity_ok:
            return first
        bs, rule = self.ns.block_size, rep.mm_match_rule
        total = first
        for prompt, keys in self.rest:
            blocks = self.state.index.lookup.match(keys, [rep.id]).get(rep.id, 0)
            total += usable_match(blocks * bs, len(prompt), bs, prompt.mm_items, rule)
        return total

    def prefix_hint(self) -> str | None:
        return None  # several inputs, and `predicted` adds up all their hits

    def speculative_keys(self) -> list[BlockKey]:
        """Every input's keys, in one guess that lives as long as the request."""
        return [k for keys in (self.keys, *(keys for _, keys in self.rest)) for k in keys]
