"""The request path: parse -> render + block keys -> score -> proxy, plus the accounting."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from typing import Any

import xxhash
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from cachekey.errors import RenderError
from cachekey.keys import block_keys, clamp_match
from cachekey.types import Prompt
from gateway.policies import RouteContext
from gateway.protocol import ChatCompletionRequest, CompletionRequest, error_response
from gateway.proxy import NoReplicaError, SSERelay, relay_stream, send_with_retries
from gateway.replicas import Replica
from gateway.state import GatewayState

log = logging.getLogger(__name__)

POLICY_HEADER = "x-kvgate-routing-policy"
_IMAGE_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"))


def _mime(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((m for magic, m in _IMAGE_MAGIC if data.startswith(magic)), "image/png")


def _image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The image content parts in the order the renderer walks them."""
    parts = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            parts += [p for p in content if isinstance(p, dict) and p.get("type") == "image_url"]
    return parts


def pin_images(messages: list[dict[str, Any]], prompt: Prompt) -> None:
    """Give every image part its identifier as `uuid`; inline fetched remote images."""
    parts = _image_parts(messages)
    if len(parts) != len(prompt.mm_items):
        return
    for part, item in zip(parts, prompt.mm_items, strict=True):
        image = part.get("image_url")
        url = image.get("url", "") if isinstance(image, dict) else image or ""
        if url.startswith(("http://", "https://")) and item.identifier in prompt.mm_data:
            data = prompt.mm_data[item.identifier]
            inline = f"data:{_mime(data)};base64,{base64.b64encode(data).decode()}"
            part["image_url"] = {**image, "url": inline} if isinstance(image, dict) else inline
        part["uuid"] = item.identifier


class OpenAIServing:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "/v1/chat/completions", ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "/v1/completions", CompletionRequest)

    async def _handle(self, request: Request, path: str, model_cls: type) -> Response:
        st = self.state
        try:
            body = json.loads(await request.body())
            req = model_cls.model_validate(body)
        except ValueError as e:  # JSONDecodeError and ValidationError are ValueErrors
            param = None
            if isinstance(e, ValidationError) and e.errors():
                param = ".".join(str(x) for x in e.errors()[0]["loc"])
            return error_response(400, f"invalid request: {e}", param=param)
        policy_name = request.headers.get(POLICY_HEADER) or st.config.policy
        policy = st.policies.get(policy_name)
        if policy is None:
            return error_response(
                400, f"unknown routing policy {policy_name!r}", param=POLICY_HEADER
            )
        candidates = st.replicas.available()
        if req.model:
            same_model = [r for r in candidates if r.model == req.model]
            candidates = same_model or candidates
        ns = st.namespace_for(candidates)
        if not candidates or ns is None:
            return error_response(503, "no healthy worker", "service_unavailable")

        t0 = time.perf_counter()
        try:
            renderer = await st.get_renderer()
            prompt, keys = await asyncio.get_running_loop().run_in_executor(
                st.render_pool, self._render, renderer, req, ns
            )
        except RenderError as e:
            return error_response(e.status_code, e.message, e.error_type, e.param, type(e).__name__)
        except RuntimeError as e:  # assets could not be loaded
            return error_response(503, str(e), "service_unavailable")
        st.metrics.render_seconds.observe(time.perf_counter() - t0)

        t1 = time.perf_counter()
        bs = ns.block_size
        usable = [r.id for r in candidates if r.parity_ok]
        matched = st.index.match(keys, usable)
        seed = keys[0] if keys else xxhash.xxh3_128_digest(str(prompt.token_ids[:bs]).encode())
        ctx = RouteContext(candidates, keys, len(prompt), bs, matched, request.headers, seed)
        ranked = await policy.rank(ctx)
        st.metrics.routing_seconds.observe(time.perf_counter() - t1)

        if isinstance(req, ChatCompletionRequest):
            pin_images(body["messages"], prompt)
        client_wants_usage = bool((req.stream_options or {}).get("include_usage"))
        if req.stream:
            body["stream_options"] = {**(req.stream_options or {}), "include_usage": True}
        return await self._forward(
            path,
            body,
            prompt,
            keys,
            ranked,
            matched,
            policy_name,
            bs,
            req.stream,
            client_wants_usage,
        )

    @staticmethod
    def _render(renderer, req, ns) -> tuple[Prompt, list]:
        if isinstance(req, ChatCompletionRequest):
            prompt = renderer.render_chat(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                tools=req.tools,
                chat_template_kwargs=req.chat_template_kwargs,
            )
        else:
            p = req.prompt
            if isinstance(p, list) and p and not isinstance(p[0], int):
                p = p[0]  # a batch is routed by its first prompt
            prompt = renderer.render_completion(p)
        keys = block_keys(prompt.token_ids, ns, prompt.mm_items, None, req.cache_salt)
        return prompt, keys

    async def _forward(
        self,
        path: str,
        body: dict,
        prompt: Prompt,
        keys: list,
        ranked: list[Replica],
        matched: dict,
        policy_name: str,
        bs: int,
        stream: bool,
        client_wants_usage: bool,
    ) -> Response:
        st = self.state
        n_tokens = len(prompt)
        predicted: dict[str, int] = {}

        def on_try(rep: Replica) -> None:
            cached = clamp_match(matched.get(rep.id, 0) * bs, n_tokens, bs, prompt.mm_items)
            predicted[rep.id] = cached if rep.parity_ok else 0
            rep.in_flight += 1
            rep.in_flight_prefill_tokens += n_tokens - cached
            rep.add_recent_prefill(n_tokens - cached, time.monotonic(), st.config.recent_half_life)
            st.metrics.in_flight.labels(rep.id).set(rep.in_flight)
            if rep.parity_ok:
                st.index.add_speculative(rep.id, keys)

        def release(rep: Replica) -> None:
            rep.in_flight -= 1
            rep.in_flight_prefill_tokens -= n_tokens - predicted[rep.id]
            st.metrics.in_flight.labels(rep.id).set(rep.in_flight)

        def on_fail(rep: Replica) -> None:
            release(rep)
            st.replicas.record_failure(rep)
            st.metrics.requests.labels(rep.id, policy_name, "retried").inc()
            st.metrics.retries.inc()

        payload = json.dumps(body).encode()
        try:
            attempt = await send_with_retries(
                ranked,
                path,
                payload,
                stream=stream,
                max_attempts=st.config.retries + 1,
                on_try=on_try,
                on_fail=on_fail,
            )
        except NoReplicaError as e:
            st.metrics.requests.labels("none", policy_name, "error").inc()
            if e.last_status is not None:
                return Response(e.last_body, e.last_status, media_type="application/json")
            return error_response(502, f"all replicas failed: {e}", "bad_gateway")
        rep, resp = attempt.replica, attempt.response
        st.replicas.record_success(rep)
        headers = {
            "x-kvgate-replica": rep.id,
            "x-kvgate-predicted-cached-tokens": str(predicted[rep.id]),
        }

        def finish(status: str, usage: dict | None) -> None:
            release(rep)
            st.metrics.requests.labels(rep.id, policy_name, status).inc()
            self._account(rep, n_tokens, predicted[rep.id], usage)

        if not stream or resp.status_code != 200:
            content = await resp.aread() if stream else resp.content
            if stream:
                await resp.aclose()
            usage = None
            if resp.status_code == 200:
                try:
                    usage = json.loads(content).get("usage")
                except ValueError:
                    usage = None
            finish(str(resp.status_code), usage)
            media = resp.headers.get("content-type", "application/json")
            return Response(content, resp.status_code, headers=headers, media_type=media)

        relay = SSERelay(strip_usage=not client_wants_usage)
        gen = relay_stream(resp, relay, lambda status: finish(status, relay.usage))
        return StreamingResponse(gen, media_type="text/event-stream", headers=headers)

    def _account(self, rep: Replica, n_tokens: int, predicted: int, usage: dict | None) -> None:
        m = self.state.metrics
        m.prompt_tokens.labels(rep.id).inc(n_tokens)
        m.predicted_cached.labels(rep.id).inc(predicted)
        details = (usage or {}).get("prompt_tokens_details") or {}
        reported = details.get("cached_tokens")
        if reported is not None:
            m.reported_cached.labels(rep.id).inc(reported)
            m.prediction_error.observe(abs(predicted - reported))
