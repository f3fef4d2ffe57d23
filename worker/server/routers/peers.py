"""Small endpoints that let third-party routers sit in front of a kvgate worker.

SGLang's router asks a backend for /server_info (or /get_server_info), /model_info (or
/get_model_info, whose model_path must be a local directory) and /get_load; vllm-router's
cache_aware policy renders every request through /v1/*/render or /tokenize.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from cachekey.openai.errors import APIError
from cachekey.openai.validation import MISSING_PARAMETER
from worker.server.app_state import WorkerState, all_ranks, rank_state, worker_state
from worker.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

router = APIRouter()


def server_info(raw: Request) -> dict:
    state = worker_state(raw)
    info, s = state.info, state.engine.stats()
    return {
        "model_path": info.model_path,
        "tokenizer_path": info.model_path,
        "served_model_name": info.model,
        "is_generation": True,
        "context_length": info.max_model_len,
        "max_total_num_tokens": s.num_blocks * s.block_size,
        "page_size": s.block_size,
        "max_running_requests": state.max_num_seqs,
        "dp_size": len(all_ranks(raw)),
        "dp_rank": info.data_parallel_rank or 0,
        "disaggregation_mode": "null",
        "version": "kvgate-worker",
    }


def model_info(raw: Request) -> dict:
    info = worker_state(raw).info
    return {
        "model_path": info.model_path,
        "tokenizer_path": info.model_path,
        "is_generation": True,
        "served_model_name": info.model,
    }


for _path in ("/get_server_info", "/server_info"):
    router.add_api_route(_path, server_info, methods=["GET"])
for _path in ("/get_model_info", "/model_info"):
    router.add_api_route(_path, model_info, methods=["GET"])


@router.get("/get_load")
async def get_load(raw: Request) -> list[dict]:
    """One entry per data-parallel rank, as SGLang's data-parallel servers answer."""
    out = []
    for state in all_ranks(raw):
        s = state.engine.stats()
        out.append(
            {
                "dp_rank": state.rank or 0,
                "num_reqs": s.num_running + s.num_waiting,
                "num_waiting_reqs": s.num_waiting,
                "num_tokens": round(s.kv_cache_usage * s.num_blocks * s.block_size),
            }
        )
    return out


def _checked(raw: Request, model: str | None) -> WorkerState:
    state = rank_state(raw)  # a bad X-data-parallel-rank is a 400 here
    state.chat.lora_name(model)  # 404 unless the served model or one of its LoRA adapters
    return state


@router.post("/v1/chat/completions/render")
async def render_chat(body: ChatCompletionRequest, raw: Request) -> dict:
    chat = _checked(raw, body.model).chat
    prompt = await chat.render(
        body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs
    )
    return {"token_ids": list(prompt.token_ids)}


@router.post("/v1/completions/render")
async def render_completion(body: CompletionRequest, raw: Request) -> dict:
    prompt = await _checked(raw, body.model).completion.render(body.single_prompt())
    return {"token_ids": list(prompt.token_ids)}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> dict:
    state = _checked(raw, body.model)
    if body.messages is not None:
        prompt = await state.chat.render(
            body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs
        )
    elif body.prompt is not None:
        prompt = await state.completion.render(body.prompt)
    else:
        raise APIError(
            400, "either prompt or messages is required", param="prompt", code=MISSING_PARAMETER
        )
    tokens = list(prompt.token_ids)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.info.max_model_len}
