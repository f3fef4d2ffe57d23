"""The request path: parse -> render + block keys -> score -> proxy."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import xxhash
from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from cachekey.errors import RenderError
from cachekey.keys import HashNamespace, block_keys
from cachekey.render import IMAGE_PART_TYPES, ImageOptions
from cachekey.types import BlockKey, Prompt
from gateway.accounting import RequestLedger
from gateway.admission import Overloaded
from gateway.fetch import image_options
from gateway.limits import LimitError, check_body, fill_max_tokens, read_json, render_error_hint
from gateway.policies import Policy, RouteContext
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_response,
    invalid_request,
)
from gateway.proxy import (
    NoReplicaError,
    RelayResponse,
    SSERelay,
    relay_stream,
    send_with_retries,
)
from gateway.replicas import Replica
from gateway.state import GatewayState
from gateway.tenants import AuthError

log = logging.getLogger(__name__)

POLICY_HEADER = "x-kvgate-routing-policy"
_IMAGE_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"))

OpenAIRequest = ChatCompletionRequest | CompletionRequest


class RequestError(Exception):
    """A request the gateway answers itself, with an OpenAI error body."""

    def __init__(self, response: Response) -> None:
        super().__init__()
        self.response = response


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
            parts += [
                p for p in content if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
            ]
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


def render_request(
    renderer, req: OpenAIRequest, ns: HashNamespace, images: ImageOptions
) -> tuple[Prompt, list]:
    """Prompt and block keys of a request (runs in the render thread pool)."""
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
    return prompt, block_keys(prompt.token_ids, ns, prompt.mm_items, None, req.cache_salt)


def authenticate(state: GatewayState, request: Request) -> str | None:
    """The request's tenant (None when the gateway has no API keys); 401 otherwise."""
    if state.tenants is None:
        return None
    try:
        return state.tenants.authenticate(request.headers.get("authorization"))
    except AuthError as e:
        resp = error_response(
            401, str(e), "authentication_error", code="invalid_api_key",
            headers={"www-authenticate": "Bearer"},
        )  # fmt: skip
        raise RequestError(resp) from e


class OpenAIServing:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "/v1/chat/completions", ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "/v1/completions", CompletionRequest)

    async def _handle(self, request: Request, path: str, model_cls: type) -> Response:
        try:
            tenant = authenticate(self.state, request)
            body, req = await self._parse(request, model_cls)
            if tenant is not None:
                # Replaces any client salt by one derived from (tenant, client salt): the
                # routing keys and the worker's cache both use it.
                assert self.state.tenants is not None
                req.cache_salt = body["cache_salt"] = self.state.tenants.salt_for(
                    tenant, req.cache_salt
                )
            policy_name, policy = self._policy(request)
            candidates, ns = self._candidates(req)
            prompt, keys = await self._render(req, ns, tenant)
            context = [r.info.get("max_model_len") if r.info else None for r in candidates]
            context_len = min(c or self.state.renderer.assets.max_model_len for c in context)
            fill_max_tokens(
                body, req.requested_max_tokens(), len(prompt), context_len, self.state.config.limits
            )
            ranked, ledger = await self._route(
                request, policy, policy_name, candidates, ns, prompt, keys
            )
            ranked = await self._admit(ranked)
        except RequestError as e:
            return e.response
        slot = ranked[0].id
        streaming = False
        try:
            if isinstance(req, ChatCompletionRequest):
                pin_images(body["messages"], prompt)
            wants_usage = bool((req.stream_options or {}).get("include_usage"))
            if req.stream:
                body["stream_options"] = {**(req.stream_options or {}), "include_usage": True}
            resp = await self._forward(
                path,
                json.dumps(body).encode(),
                ranked,
                ledger,
                req.stream,
                wants_usage,
                lambda: self.state.admission.release(slot),
            )
            streaming = isinstance(resp, RelayResponse)
            return resp
        finally:
            if not streaming:  # a stream releases its slot when it ends
                self.state.admission.release(slot)

    async def _parse(self, request: Request, model_cls: type) -> tuple[dict, OpenAIRequest]:
        limits = self.state.config.limits
        try:
            body = await read_json(request, limits)
            check_body(body, limits)
            return body, model_cls.model_validate(body)
        except LimitError as e:
            resp = error_response(e.status, e.message, param=e.param, code=e.code)
            raise RequestError(resp) from e
        except ValidationError as e:
            message, param, code = invalid_request(e)
            raise RequestError(error_response(400, message, param=param, code=code)) from e

    def _policy(self, request: Request) -> tuple[str, Policy]:
        name = request.headers.get(POLICY_HEADER) or self.state.config.policy
        policy = self.state.policies.get(name)
        if policy is None:
            msg = f"unknown routing policy {name!r}"
            raise RequestError(error_response(400, msg, param=POLICY_HEADER))
        return name, policy

    def _candidates(self, req: OpenAIRequest) -> tuple[list[Replica], HashNamespace]:
        candidates = self.state.replicas.available()
        if req.model:
            serving = [r for r in candidates if r.model == req.model]
            everyone = self.state.replicas.replicas.values()
            if candidates and not serving and all(r.model != req.model for r in everyone):
                msg = f"The model `{req.model}` does not exist."
                raise RequestError(error_response(404, msg, "NotFoundError", "model"))
            candidates = serving
        ns = self.state.namespace_for(candidates)
        if not candidates or ns is None:
            raise RequestError(error_response(503, "no healthy worker", "service_unavailable"))
        return candidates, ns

    async def _render(
        self, req: OpenAIRequest, ns: HashNamespace, tenant: str | None
    ) -> tuple[Prompt, list]:
        st = self.state
        t0 = time.perf_counter()
        images = image_options(st.fetcher, st.config.allow_image_uuids, tenant)
        try:
            renderer = await st.get_renderer()
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(
                st.render_pool, render_request, renderer, req, ns, images
            )
        except RenderError as e:
            msg = e.message + render_error_hint(e)
            resp = error_response(e.status_code, msg, e.error_type, e.param, type(e).__name__)
            raise RequestError(resp) from e
        except RuntimeError as e:  # the render assets could not be loaded
            raise RequestError(error_response(503, str(e), "service_unavailable")) from e
        st.metrics.render_seconds.observe(time.perf_counter() - t0)
        return out

    async def _admit(self, ranked: list[Replica]) -> list[Replica]:
        """Take an in-flight slot; the replica holding it is tried first."""
        try:
            rep = await self.state.admission.acquire(ranked)
        except Overloaded as e:
            self.state.metrics.requests.labels("none", "admission", "overloaded").inc()
            resp = error_response(
                429, e.message, "rate_limit_error", code="overloaded",
                headers={"retry-after": str(e.retry_after)},
            )  # fmt: skip
            raise RequestError(resp) from e
        return [rep, *(r for r in ranked if r is not rep)]

    async def _route(
        self,
        request: Request,
        policy: Policy,
        policy_name: str,
        candidates: list[Replica],
        ns: HashNamespace,
        prompt: Prompt,
        keys: list[BlockKey],
    ) -> tuple[list[Replica], RequestLedger]:
        st = self.state
        t0 = time.perf_counter()
        bs = ns.block_size
        matched = st.index.match(keys, [r.id for r in candidates if r.parity_ok])
        seed = keys[0] if keys else xxhash.xxh3_128_digest(repr(prompt.token_ids[:bs]).encode())
        ctx = RouteContext(candidates, keys, len(prompt), bs, matched, request.headers, seed)
        ranked = await policy.rank(ctx)
        st.metrics.routing_seconds.observe(time.perf_counter() - t0)
        return ranked, RequestLedger(st, prompt, keys, matched, bs, policy_name)

    async def _forward(
        self,
        path: str,
        payload: bytes,
        ranked: list[Replica],
        ledger: RequestLedger,
        stream: bool,
        wants_usage: bool,
        release: Callable[[], None],
    ) -> Response:
        st = self.state
        try:
            attempt = await send_with_retries(
                ranked,
                path,
                payload,
                stream=stream,
                max_attempts=st.config.retries + 1,
                on_try=ledger.begin,
                on_fail=ledger.fail,
            )
        except NoReplicaError as e:
            st.metrics.requests.labels("none", ledger.policy, "error").inc()
            if e.last_status is not None:
                return Response(e.last_body, e.last_status, media_type="application/json")
            return error_response(502, f"all replicas failed: {e}", "bad_gateway")
        rep, resp = attempt.replica, attempt.response
        st.replicas.record_success(rep)
        headers = {
            "x-kvgate-replica": rep.id,
            "x-kvgate-predicted-cached-tokens": str(ledger.predicted[rep.id]),
        }
        if stream and resp.status_code == 200:
            relay = SSERelay(strip_usage=not wants_usage)

            ended = False

            def on_end(status: str) -> None:
                nonlocal ended
                if not ended:
                    ended = True
                    release()
                    ledger.finish(rep, status, relay.usage)

            async def on_close() -> None:
                # A no-op after a normal end; otherwise the client left before the first byte.
                if not ended:
                    await resp.aclose()
                    on_end("client_gone")

            gen = relay_stream(resp, relay, on_end)
            return RelayResponse(gen, on_close, media_type="text/event-stream", headers=headers)
        content = await resp.aread()
        await resp.aclose()
        usage = None
        if resp.status_code == 200:
            try:
                usage = json.loads(content).get("usage")
            except (ValueError, AttributeError):
                usage = None
        ledger.finish(rep, str(resp.status_code), usage)
        media = resp.headers.get("content-type", "application/json")
        return Response(content, resp.status_code, headers=headers, media_type=media)
