"""/v1/embeddings: one engine request per input, each pooled from the final hidden states.

Every input is a prefill-only request (one greedy token is sampled and dropped), so it uses
and fills the prefix cache exactly as a completion with the same prompt would: the gateway
routes it with the same keys, and `usage.prompt_tokens_details.cached_tokens` counts its hits.
A `model` that names a LoRA adapter runs the forward pass with that adapter, and its blocks are
keyed with the adapter's name, as a completion's are.
`last` pooling needs only the last prompt token, which is always computed; `mean` needs every
prompt token, so it needs the hidden-state cache (`--hidden-state-cache`).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import numpy as np
from fastapi import Request
from fastapi.responses import Response

from cachekey.errors import context_exceeded
from cachekey.openai.errors import INVALID_VALUE, APIError
from cachekey.types import Prompt
from worker.engine.sampling_params import SamplingParams
from worker.server.arrival_order import Turn
from worker.server.embedding_protocol import EmbeddingRequest
from worker.server.hidden_encoding import b64_floats, require_hidden_cache
from worker.server.request_stream import RequestStream, unless_gone
from worker.server.serving import OpenAIServing, ServingContext

_json = msgspec.json.Encoder()
_PREFILL_ONLY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class ServingEmbedding(OpenAIServing):
    id_prefix = "embd"

    def __init__(self, ctx: ServingContext, model_config: dict) -> None:
        super().__init__(ctx)
        # Matryoshka models say which output sizes they were trained for (vLLM's convention).
        dims = model_config.get("matryoshka_dimensions")
        self.matryoshka = bool(model_config.get("is_matryoshka") or dims)
        self.matryoshka_dims = tuple(dims) if dims else None
        text = model_config.get("text_config") or model_config
        self.hidden_size = int(text.get("hidden_size", 0))

    async def create(self, raw: Request, body: EmbeddingRequest) -> Response:
        turn = self.ctx.order.take()
        try:
            stream = await self._add(raw, body, turn)
        finally:
            turn.leave()
        results = await self._collect(raw, stream)
        if results is None:
            return Response(status_code=499)  # nobody is listening any more
        return Response(_json.encode(self._response(body, results)), media_type="application/json")

    async def _add(self, raw: Request, body: EmbeddingRequest, turn: Turn) -> RequestStream:
        """Check and render the inputs, then add them to the engine in arrival order."""
        lora_name = self.check_request(raw, body)
        if body.pooling == "mean":
            require_hidden_cache(self.ctx.hidden_layers, "pooling `mean`", "pooling")
        self.check_dimensions(body.dimensions)
        prompts = await self.render_inputs(body)
        for i, prompt in enumerate(prompts):
            if len(prompt) >= self.ctx.max_model_len:
                where = "input" if len(prompts) == 1 else f"input[{i}]"
                raise context_exceeded(self.ctx.max_model_len, len(prompt), where, param="input")
        rid = f"{self.id_prefix}-{uuid.uuid4().hex}"
        # One command adds every input, so they enter the engine together: none hits blocks
        # that another input of the same request stores (which no router could predict), as
        # long as they fit in one step.
        await turn.reached()
        return await self.ctx.engine.add(
            [f"{rid}-{i}" for i in range(len(prompts))],
            prompts,
            [_PREFILL_ONLY] * len(prompts),
            lora_name=lora_name,
            cache_salt=body.cache_salt,
            hidden_states=body.pooling,
            param="input",
        )

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        if not self.matryoshka:
            raise APIError(
                400,
                "this model does not support `dimensions` (it is not a Matryoshka model)",
                param="dimensions",
                code=INVALID_VALUE,
            )
        if dimensions > self.hidden_size:
            raise APIError(
                400,
                f"`dimensions` must be at most the model's {self.hidden_size}",
                param="dimensions",
                code=INVALID_VALUE,
            )
        if self.matryoshka_dims is not None and dimensions not in self.matryoshka_dims:
            raise APIError(
                400,
                f"`dimensions` must be one of {list(self.matryoshka_dims)}",
                param="dimensions",
                code=INVALID_VALUE,
            )

    async def render_inputs(self, body: EmbeddingRequest) -> list[Prompt]:
        renderer = self.ctx.renderer
        if body.messages is not None:
            prompt = await asyncio.to_thread(
                renderer.render_chat,
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                chat_template_kwargs=body.chat_template_kwargs,
            )
            return [prompt]
        inputs = body.inputs()
        return await asyncio.to_thread(
            lambda: [renderer.render_completion(p, "input") for p in inputs]
        )

    async def _collect(self, raw: Request, stream: RequestStream):
        """(vector, prompt tokens, cached tokens, of them from the host tier or None without
        one) per input; None if the client went away."""
        return await unless_gone(raw, stream, _results(stream))

    def _response(self, body: EmbeddingRequest, results: list) -> dict:
        data = []
        for i, (vector, *_) in enumerate(results):
            if body.dimensions is not None:
                vector = vector[: body.dimensions]
            if body.normalize:
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
            embedding = b64_floats(vector) if body.encoding_format == "base64" else vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        prompt_tokens = sum(r[1] for r in results)
        details = {"cached_tokens": sum(r[2] for r in results)}
        if results and results[0][3] is not None:  # a host KV tier: its share, as chat's usage
            details["cpu_cached_tokens"] = sum(r[3] for r in results)
        return {
            "id": f"{self.id_prefix}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": body.model or self.ctx.model_name,  # an adapter answers with its name
            "data": data,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens,
                "prompt_tokens_details": details,
            },
        }


async def _results(stream: RequestStream) -> list[tuple[np.ndarray, int, int, int | None]]:
    index = {rid: i for i, rid in enumerate(stream.request_ids)}
    results: list = [None] * len(index)
    async for out in stream:
        if out.finished:
            assert out.hidden_states is not None
            results[index[out.request_id]] = (
                out.hidden_states,
                out.num_prompt_tokens,
                out.num_cached_tokens,
                out.num_host_cached_tokens,
            )
    return results
