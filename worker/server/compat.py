"""Small endpoints that let third-party routers sit in front of a kvgate worker.

SGLang's router asks a backend for /server_info (or /get_server_info), /model_info (or
/get_model_info, whose model_path must be a local directory) and /get_load; vllm-router's
cache_aware policy renders every request through /v1/*/render or /tokenize.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

from worker.server.errors import APIError
from worker.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from worker.server.serving import check_rank_header

if TYPE_CHECKING:
    from worker.server.app import AppState


def attach_compat_routes(app: FastAPI, state: AppState) -> None:
    def server_info() -> dict:
        s = state.engine.stats()
        return {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "served_model_name": state.model_name,
            "is_generation": True,
            "context_length": state.max_model_len,
            "max_total_num_tokens": s.num_blocks * s.block_size,
            "page_size": s.block_size,
            "max_running_requests": state.engine.engine.config.max_num_seqs,
            "dp_size": 1,
            "dp_rank": state.config.data_parallel_rank or 0,
            "disaggregation_mode": "null",
            "version": "kvgate-worker",
        }

    def model_info() -> dict:
        return {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "served_model_name": state.model_name,
        }

    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, model_info, methods=["GET"])

    @app.get("/get_load")
    async def get_load() -> list[dict]:
        s = state.engine.stats()
        used_tokens = round(s.kv_cache_usage * s.num_blocks * s.block_size)
        return [
            {
                "dp_rank": state.config.data_parallel_rank or 0,
                "num_reqs": s.num_running + s.num_waiting,
                "num_waiting_reqs": s.num_waiting,
                "num_tokens": used_tokens,
            }
        ]

    def check(raw: Request, model: str | None) -> None:
        if model is not None and model != state.model_name:
            raise APIError(
                f"The model `{model}` does not exist.", 404, param="model", code="model_not_found"
            )
        check_rank_header(raw, state.config.data_parallel_rank)

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest, raw: Request) -> dict:
        check(raw, body.model)
        prompt = await state.chat.render(
            body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs
        )
        return {"token_ids": list(prompt.token_ids)}

    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest, raw: Request) -> dict:
        check(raw, body.model)
        prompt = await state.completion.render(body.single_prompt())
        return {"token_ids": list(prompt.token_ids)}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, raw: Request) -> dict:
        check(raw, body.model)
        if body.messages is not None:
            prompt = await state.chat.render(
                body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs
            )
        elif body.prompt is not None:
            prompt = await state.completion.render(body.prompt)
        else:
            raise APIError("either prompt or messages is required", 400, param="prompt")
        tokens = list(prompt.token_ids)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}
