"""/v1/chat/completions: render the conversation (text and images) and generate."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import Response

from cachekey.types import Prompt
from worker.server.protocol import ChatCompletionRequest
from worker.server.serving import OpenAIServing


class ServingChat(OpenAIServing):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    async def create(self, raw: Request, body: ChatCompletionRequest) -> Response:
        arrived = time.perf_counter()
        turn = self.ctx.order.take()
        try:
            lora = self.check_request(raw, body)
            prompt = await self.render(
                body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs
            )
            max_tokens = body.requested_max_tokens()
            return await self.generate(raw, body, prompt, max_tokens, arrived, turn, lora)
        finally:
            turn.leave()

    async def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> Prompt:
        # Off the event loop: templating, tokenizing and image decoding take milliseconds.
        renderer = self.ctx.renderer
        return await asyncio.to_thread(
            renderer.render_chat,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )

    def final_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
