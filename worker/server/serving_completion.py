"""/v1/completions: a string or token-id prompt, generated as is."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import Response

from cachekey.types import Prompt
from worker.server.protocol import CompletionRequest
from worker.server.serving import OpenAIServing


class ServingCompletion(OpenAIServing):
    async def create(self, raw: Request, body: CompletionRequest) -> Response:
        arrived = time.perf_counter()
        turn = self.ctx.order.take()
        try:
            lora = self.check_request(raw, body)
            prompt = await self.render(body.single_prompt())
            return await self.generate(raw, body, prompt, body.max_tokens, arrived, turn, lora)
        finally:
            turn.leave()

    async def render(self, prompt: str | list[int]) -> Prompt:
        renderer = self.ctx.renderer
        return await asyncio.to_thread(renderer.render_completion, prompt)

    def final_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, first: bool) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
