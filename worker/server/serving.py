"""The part of chat and completions that is the same: checks, sampling params, running the
engine requests, usage, SSE streaming, and aborting when the client goes away."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from cachekey.errors import context_exceeded
from cachekey.headers import RANK_HEADER
from cachekey.openai.errors import INVALID_VALUE, APIError
from cachekey.openai.sse import DONE, SSE_MEDIA_TYPE, sse_event
from cachekey.render import Renderer
from cachekey.types import Prompt
from kvgate_cli.drain import SHUTTING_DOWN, OpenStreams
from worker.engine.sampling_params import SamplingParams
from worker.server.arrival_order import ArrivalOrder, Turn
from worker.server.engine_client import AsyncEngine
from worker.server.errors import as_api_error
from worker.server.faults import FaultInjector
from worker.server.hidden_encoding import encode_hidden_states, require_hidden_cache
from worker.server.metrics import EngineLatency
from worker.server.protocol import EngineRequest
from worker.server.request_stream import RequestStream, unless_gone
from worker.server.usage import cached_parts, usage_of

_json = msgspec.json.Encoder()


@dataclass(slots=True)
class ServingContext:
    engine: AsyncEngine
    renderer: Renderer
    model_name: str
    max_model_len: int
    metrics: EngineLatency  # this engine's latency histograms
    # Hugging Face hidden_states index of each kept row; empty without --hidden-state-cache.
    hidden_layers: tuple[int, ...] = ()
    order: ArrivalOrder = field(default_factory=ArrivalOrder)  # requests reach the engine FIFO
    streams: OpenStreams = field(default_factory=OpenStreams)  # what a drain cuts (all ranks')
    faults: FaultInjector | None = None  # only with --enable-fault-injection


@dataclass(slots=True)
class _Choice:
    text: list[str]
    finish_reason: str | None = None
    num_output_tokens: int = 0
    hidden_states: np.ndarray | None = None


class OpenAIServing:
    """Subclasses say how to render a request and how their choices and chunks look."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    # -- checks --------------------------------------------------------------------------------

    @property
    def prompt_field(self) -> str:
        """The request field the prompt comes from, named in the errors that blame it."""
        return "messages" if self.object_name == "chat.completion" else "prompt"

    def check_request(self, raw: Request, body: EngineRequest) -> str | None:
        """The LoRA adapter the request's `model` names (None: the base model); 404 for none.
        X-data-parallel-rank was checked when the request's engine was chosen (rank_state)."""
        lora = self.lora_name(body.model)
        self.ctx.engine.check_alive()
        return lora

    def lora_name(self, model: str | None) -> str | None:
        if model is None or model == self.ctx.model_name:
            return None
        lora = self.ctx.engine.stats().lora
        if lora is not None and any(name == model for name, _ in lora.adapters):
            return model  # the engine checks again when it adds the request
        raise APIError(
            404,
            f"The model `{model}` does not exist; this worker serves `{self.ctx.model_name}`"
            + "".join(f", `{name}`" for name, _ in (lora.adapters if lora else ()))
            + ".",
            param="model",
            code="model_not_found",
        )

    def sampling_params(self, body: EngineRequest, max_tokens: int | None, prompt_len: int):
        limit = self.ctx.max_model_len
        where = self.prompt_field
        if prompt_len >= limit:
            raise context_exceeded(limit, prompt_len, where, param=where)
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            named = getattr(body, "max_completion_tokens", None) is not None
            field = "max_completion_tokens" if named else "max_tokens"
            raise context_exceeded(limit, prompt_len, where, max_tokens, param=field)
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else None
        return [
            SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                # Siblings of one request must not sample the same tokens.
                seed=None if body.seed is None else _sibling_seed(body.seed, i),
                max_tokens=max_tokens,
                stop=body.stop_strings(),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
            )
            for i in range(body.n)
        ]

    # -- running -------------------------------------------------------------------------------

    async def generate(
        self,
        raw: Request,
        body: EngineRequest,
        prompt: Prompt,
        max_tokens: int | None,
        arrived: float,
        turn: Turn,
        lora_name: str | None = None,
    ) -> Response:
        params = self.sampling_params(body, max_tokens, len(prompt))
        request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        sub_ids = [f"{request_id}-{i}" for i in range(body.n)]
        hidden = None
        if body.return_hidden_states:
            require_hidden_cache(
                self.ctx.hidden_layers, "return_hidden_states", "return_hidden_states"
            )
            hidden = "all"
        await turn.reached()
        try:
            stream = await self.ctx.engine.add(
                sub_ids,
                prompt,
                params,
                lora_name=lora_name,
                cache_salt=body.cache_salt,
                hidden_states=hidden,
                param=self.prompt_field,
            )
        finally:
            turn.leave()
        if self.ctx.faults is not None:
            self.ctx.faults.added(body)
        if body.stream:
            return StreamingResponse(
                self._sse(stream, body, request_id, arrived), media_type=SSE_MEDIA_TYPE
            )
        handle = self.ctx.streams.add(lambda why: stream.cut(_shutting_down(why)))
        try:
            return await self._complete(raw, stream, body, request_id, arrived)
        finally:
            self.ctx.streams.discard(handle)

    async def _complete(
        self, raw: Request, stream: RequestStream, body: EngineRequest, rid: str, arrived: float
    ) -> Response:
        collected = await unless_gone(raw, stream, self._collect(stream, arrived))
        if collected is None:
            return Response(status_code=499)  # nobody is listening any more
        choices, prompt_tokens, cached = collected
        payload = {
            "id": rid,
            "object": self.object_name,
            "created": int(time.time()),
            "model": body.model or self.ctx.model_name,  # an adapter answers with its name
            "choices": [
                self._with_hidden(
                    self.final_choice(i, "".join(c.text), c.finish_reason), c.hidden_states
                )
                for i, c in enumerate(choices)
            ],
            "usage": usage_of(prompt_tokens, sum(c.num_output_tokens for c in choices), cached),
        }
        return Response(_json.encode(payload), media_type="application/json")

    async def _collect(self, stream: RequestStream, arrived: float):
        index = {rid: i for i, rid in enumerate(stream.request_ids)}
        choices = [_Choice([]) for _ in stream.request_ids]
        prompt_tokens, cached = 0, (0, None)
        first = True
        async for out in stream:
            if first:
                self.ctx.metrics.ttft.observe(time.perf_counter() - arrived)
                first = False
            self.ctx.metrics.first_token(out)
            c = choices[index[out.request_id]]
            c.text.append(out.text_delta)
            c.num_output_tokens = out.num_output_tokens
            if out.finished:
                c.finish_reason = out.finish_reason
                c.hidden_states = out.hidden_states
            if index[out.request_id] == 0:
                prompt_tokens, cached = out.num_prompt_tokens, cached_parts(out)
        self.ctx.metrics.e2e.observe(time.perf_counter() - arrived)
        return choices, prompt_tokens, cached

    async def _sse(
        self, stream: RequestStream, body: EngineRequest, rid: str, arrived: float
    ) -> AsyncIterator[bytes]:
        index = {r: i for i, r in enumerate(stream.request_ids)}
        outputs = [0] * len(index)
        started = [False] * len(index)
        prompt_tokens, cached = 0, (0, None)
        usage_on = body.include_usage()
        created = int(time.time())
        model = body.model or self.ctx.model_name
        first = True
        handle = self.ctx.streams.add(lambda why: stream.cut(_shutting_down(why)))
        try:
            async for out in stream:
                if first:
                    self.ctx.metrics.ttft.observe(time.perf_counter() - arrived)
                    first = False
                self.ctx.metrics.first_token(out)
                i = index[out.request_id]
                outputs[i] = out.num_output_tokens
                if i == 0:
                    prompt_tokens, cached = out.num_prompt_tokens, cached_parts(out)
                if started[i] and not out.text_delta and not out.finished:
                    continue
                choice = self.chunk_choice(i, out.text_delta, out.finish_reason, not started[i])
                choice = self._with_hidden(choice, out.hidden_states)  # on a finishing chunk
                started[i] = True
                yield self._chunk(rid, model, created, [choice], None if usage_on else _OMIT)
            self.ctx.metrics.e2e.observe(time.perf_counter() - arrived)
            if usage_on:
                usage = usage_of(prompt_tokens, sum(outputs), cached)
                yield self._chunk(rid, model, created, [], usage)
        except Exception as e:  # the client already has a 200: report in-band, as vLLM does
            err = as_api_error(e)
            yield sse_event(_json.encode(err.body()))
        finally:
            self.ctx.streams.discard(handle)
            stream.close()
        yield DONE

    def _chunk(self, rid: str, model: str, created: int, choices: list, usage) -> bytes:
        payload = {
            "id": rid,
            "object": self.chunk_object_name,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if usage is not _OMIT:
            payload["usage"] = usage
        return sse_event(_json.encode(payload))

    def _with_hidden(self, choice: dict, hidden: np.ndarray | None) -> dict:
        if hidden is not None:
            choice["hidden_states"] = encode_hidden_states(hidden, self.ctx.hidden_layers)
        return choice

    # -- shapes (subclasses) -------------------------------------------------------------------

    def final_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        raise NotImplementedError

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, first: bool) -> dict:
        raise NotImplementedError


_OMIT = object()


def _shutting_down(reason: str) -> APIError:
    """What a request still running when the drain's deadline passes ends with."""
    return APIError(503, reason, code=SHUTTING_DOWN)


def rank_index(raw: Request, count: int) -> int | None:
    """The engine a request names with X-data-parallel-rank: its index among this server's
    `count` engines, as vLLM reads the header (None: it names none)."""
    value = raw.headers.get(RANK_HEADER)
    if value is None:
        return None
    try:
        asked = int(value)
    except ValueError:
        raise _bad_rank(f"X-data-parallel-rank must be an integer, got {value!r}") from None
    if not 0 <= asked < count:
        raise _bad_rank(
            f"X-data-parallel-rank {asked} is out of range [0, {count}): this worker serves "
            f"{count} engine(s)"
        )
    return asked


def _bad_rank(message: str) -> APIError:
    """A header's value, named as the gateway names its own headers' (x-kvgate-routing-policy)."""
    return APIError(400, message, param=RANK_HEADER, code=INVALID_VALUE)


def _sibling_seed(seed: int, i: int) -> int:
    """Choice i's seed, `seed + i` wrapped within int64: a client's `seed` may be any int64, and
    `2**63 - 1` with `n: 2` was refused for a seed the request never sent."""
    return (seed + i + 2**63) % 2**64 - 2**63
