"""One ext_proc stream: one HTTP request through the proxy, from its headers to its answer's end.

Request phase: the headers (path, API key, the proxy's endpoint subset, its body mode), then the
body, read by the HTTP gateway's own `read_request` (limits, tenants) and routed by the same
`ProxyRequest.route` + `decide`. The pick (gateway/epp/wire.py) and the body to forward
(`ProxyRequest.payload`: images pinned as the gateway keyed them) go back as the proxy's body
mode (`protocol_config`) wants them:

- FULL_DUPLEX_STREAMED (and a proxy that sends no `protocol_config`): the proxy streams the body
  without waiting; the headers are answered with the pick once the body is whole, then the new
  body is streamed back.
- BUFFERED: the proxy waits for the headers' answer before it sends the body, so the headers
  are answered at once and the pick rides on the answer to the body (whole, in one message).
- STREAMED: the proxy also waits, then routes the request on its headers' answer. kvgate asks
  it to buffer the body instead (`mode_override`, which Envoy honours with
  `allow_mode_override: true`) and names a pick by load in that answer for a proxy that does
  not; with `send_body_without_waiting_for_header_response` it answers as in full duplex.

Response phase: the response headers say where the request was served (gateway/epp/served.py)
and get `x-kvgate-replica` and `x-kvgate-predicted-cached-tokens`; the body passes back
unchanged while its usage is read. The stream ends with the answer's last message (the slot is
released then), or earlier, however it ends.

A request the gateway refuses (bad body, unknown model, over a limit, no ready endpoint,
overload) is an immediate response with the HTTP gateway's status and OpenAI error body. An
unexpected failure aborts the stream instead, so the proxy applies the InferencePool's
`failureMode` (FailOpen: route without the EPP; FailClose: an error).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from cachekey.headers import PREFIX_HEADER, RANK_HEADER
from cachekey.openai.errors import APIError
from cachekey.openai.sse import SSE_MEDIA_TYPE
from cachekey.worker_auth import bearer
from gateway.errors import as_gateway_error
from gateway.fleet.replica import Replica
from gateway.names import ReplicaId
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.routing.policies import RouteContext
from gateway.routing.request import ProxyRequest
from gateway.serving.exchange import Exchange
from gateway.serving.usage import SSERelay, read_usage
from gateway.state import GatewayState

from . import served, wire
from .body import (
    BUFFERED,
    DUPLEX,
    EARLY,
    MODE_NAMES,
    NO_BODY,
    STREAMED,
    BodySource,
    ProtocolError,
    request_style,
    warn_streamed,
)
from .rpc import Abort, Call, Status

log = logging.getLogger(__name__)

ROUTES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
_USAGE_BODY_BYTES = 1 << 20  # a non-streamed answer longer than this is not read for usage


class ExtProcStream:
    def __init__(self, state: GatewayState, messages: AsyncIterator, context: Call) -> None:
        self.state = state
        self.messages = messages
        self.context = context
        self.exchange: Exchange | None = None  # the request down the shared path, once read
        self.status = "unobserved"  # the answer's status, once the proxy shows the answer
        self.usage: dict | None = None
        self.style = DUPLEX
        self.echo_response = True  # full duplex answers: the response body is sent back
        self.duplex_declared = False  # the proxy said full duplex (it never waits for answers)
        self.rank: int | None = None  # the X-data-parallel-rank sent with the pick
        self._relay: SSERelay | None = None
        self._streaming = False  # the stream's first bytes came back
        self._body = bytearray()

    @property
    def px(self) -> ProxyRequest | None:
        """The routed request (None: not routed, or routed by load alone)."""
        return self.exchange.px if self.exchange is not None else None

    async def run(self) -> AsyncIterator:
        try:
            first = await anext(self.messages, None)
            if first is None:
                return
            if first.WhichOneof("request") != "request_headers":
                raise ProtocolError("the stream must start with the request headers")
            self.style = request_style(first)
            response_mode = wire.body_modes(first)[1]
            self.echo_response = response_mode in (None, ProcessingMode.FULL_DUPLEX_STREAMED)
            self.duplex_declared = response_mode == ProcessingMode.FULL_DUPLEX_STREAMED
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "ext_proc stream: request body %s, response body %s: answered %s",
                    *(MODE_NAMES.get(m, "not given") for m in wire.body_modes(first)),
                    self.style,
                )
            refused = False
            async for out in self._request(first):
                refused = out.HasField("immediate_response")
                yield out
            if not refused:
                async for out in self._response():
                    yield out
        except ProtocolError as e:
            await self.context.abort(Status.INVALID_ARGUMENT, str(e))
        finally:
            if self.exchange is not None and self.exchange.px is not None:
                self.exchange.end(self.status, self.usage)

    # ---- request phase ---------------------------------------------------------------------

    async def _request(self, first) -> AsyncIterator:
        st, h = self.state, first.request_headers
        headers = wire.header_dict(h.headers)
        subset = self._subset(wire.subset_hint(first.metadata_context))
        path = headers.get(":path", "").split("?", 1)[0]
        model_cls = ROUTES.get(path) if headers.get(":method") == "POST" else None
        source = BodySource(headers, self.messages, ended=h.end_of_stream)
        try:
            if model_cls is None or self.style == NO_BODY:  # no body to key: routed by load
                rep = await self._by_load(headers, subset)
                open_path = model_cls or (headers.get(":method"), path) in _OPEN_BY_LOAD
                auth = _to_worker(st) if open_path else {}
                yield wire.route_response([wire.endpoint_of(rep.url)], auth)
                async for out in self._echo_request(source):
                    yield out
                return
            provisional = None
            if self.style == BUFFERED:
                yield wire.continue_request_headers()
            elif self.style == STREAMED:
                provisional = await self._by_load(headers, subset)
                override = wire.buffered_mode(wire.body_modes(first)[1])
                yield wire.route_response([wire.endpoint_of(provisional.url)], _to_worker(st),
                                          mode_override=override)  # fmt: skip
            ex = self.exchange = Exchange(st, headers)

            def read_subset() -> set[ReplicaId] | None:
                if provisional is not None and source.count > 1:
                    warn_streamed()  # the body came in pieces: the proxy routed already
                    return {provisional.id}
                return subset

            px = await ex.route(source, path, model_cls, read_subset)
        except (ProtocolError, Abort):
            raise
        except Exception as e:
            yield await self._refuse(e, headers)
            return
        payload = px.payload(usage_chunk=False)
        endpoints, extra = self._pick(px, payload)
        if self.style in (DUPLEX, EARLY):
            yield wire.route_response(endpoints, extra)
        if self.style == DUPLEX:
            for out in wire.body_responses(payload, end=not source.trailers, response=False):
                yield out
        else:
            for out in wire.routed_body_responses(endpoints, extra, payload, source.count):
                yield out
        if source.trailers:
            yield wire.trailers_response(response=False)

    def _pick(self, px: ProxyRequest, payload: bytes) -> tuple[list[str], dict[str, str]]:
        """The endpoints to name (the pick, then up to --epp-fallbacks) and the headers the
        proxy must set on the forwarded request."""
        # One X-data-parallel-rank header goes to whichever endpoint the proxy picks, so the
        # fallbacks are the replicas that take the same header (vLLM: the rank's index).
        rank = self.rank = px.ranked[0].rank_header
        n = 1 + self.state.config.epp_fallbacks
        same = [r for r in px.ranked if r.rank_header == rank]
        endpoints = list(dict.fromkeys(wire.endpoint_of(r.url) for r in same))[:n]
        extra = {"content-length": str(len(payload)), **_to_worker(self.state)}
        if rank is not None:
            extra[RANK_HEADER] = str(rank)
        # The pick's predicted hit; a fallback endpoint refreshes that chain only if it holds it.
        if (hint := px.prefix_hint()) is not None:
            extra[PREFIX_HEADER] = hint
        return endpoints, extra

    async def _echo_request(self, source: BodySource) -> AsyncIterator:
        async for chunk in source.stream():
            if self.style != DUPLEX:
                yield wire.body_unchanged(response=False)
                continue
            for out in wire.body_responses(chunk, end=source.ended and not source.trailers,
                                           response=False):  # fmt: skip
                yield out
        if source.trailers:
            yield wire.trailers_response(response=False)

    def _subset(self, hint: list[str] | None) -> set[ReplicaId] | None:
        if hint is None:
            return None
        allowed = set(hint)
        reps = self.state.replicas
        return {r.id for r in reps if wire.endpoint_of(r.url) in allowed}

    async def _by_load(self, headers: Mapping[str, str], subset: set[ReplicaId] | None) -> Replica:
        reps = self.state.replicas.available()
        if subset is not None:
            reps = [r for r in reps if r.id in subset]
        if not reps:
            msg = "no healthy worker: " + self.state.replicas.describe()
            raise APIError(503, msg, code="no_healthy_worker")
        ctx = RouteContext(reps, [], 0, 1, headers=headers)
        return self.state.policies["least_loaded"].rank(ctx)[0]

    async def _refuse(self, exc: Exception, headers: Mapping[str, str]):
        err = as_gateway_error(exc)  # logs an unexpected one
        self.status = str(err.status)
        if self.px is None:  # refused before it was routed; a routed one ends in run()
            (self.exchange or Exchange(self.state, headers)).end(self.status)
        if err.status >= 500 and not isinstance(exc, APIError):
            # Not the request's fault: the proxy's failure mode decides, as when the EPP is down.
            await self.context.abort(Status.INTERNAL, err.message)
        return wire.immediate_response(err)

    # ---- response phase --------------------------------------------------------------------

    async def _response(self) -> AsyncIterator:
        """Until the answer's last message (its end of stream): then the EPP ends the stream
        itself, so the slot is released as the answer ends, not when the proxy closes the
        stream after the client got it (a moment later, often after the client's next
        request was routed)."""
        held = None  # a JSON answer's headers answer, sent with its body's
        while (msg := await anext(self.messages, None)) is not None:
            kind = msg.WhichOneof("request")
            if kind == "response_headers":
                answer = wire.headers_response(self._on_response_headers(msg))
                last = msg.response_headers.end_of_stream
                # A proxy that declared full duplex sends the body without waiting for this
                # answer, and a JSON body follows at once: one write for both saves the
                # proxy a wake-up. (A stream's headers go at once: its first token may wait.)
                if self.duplex_declared and self._relay is None and not last:
                    held = answer
                    continue
                yield answer
            elif kind == "response_body":
                if held is not None:
                    yield held
                    held = None
                b = msg.response_body
                last = b.end_of_stream
                self._read_usage(b.body, last)
                if not self.echo_response:
                    yield wire.body_unchanged(response=True)
                else:
                    for out in wire.body_responses(b.body, end=last, response=True):
                        yield out
            elif kind == "response_trailers":
                if held is not None:
                    yield held
                    held = None
                yield wire.trailers_response(response=True)
                last = True
            else:
                raise ProtocolError(f"{kind} after the request was answered")
            if last:
                return

    def _on_response_headers(self, msg) -> dict[str, str]:
        headers = wire.header_dict(msg.response_headers.headers)
        self.status = headers.get(":status", self.status)
        if SSE_MEDIA_TYPE in headers.get("content-type", ""):
            self._relay = SSERelay(strip_usage=False)
        px = self.px
        if px is None:
            return {}
        served.settle(self.state, px, msg, self.rank)
        if px.lease.replica is None:
            return {}
        status = self.status
        assert self.exchange is not None
        return self.exchange.replica_headers(int(status) if status.isdigit() else 200)

    def _read_usage(self, chunk: bytes, end: bool) -> None:
        if self.px is None or self.px.lease.replica is None:
            return
        if self._relay is not None:
            if chunk and not self._streaming:
                self._streaming = True
                # A worker sends a stream's first bytes with its first token.
                self.px.lease.first_token()
            self._relay.feed(chunk)  # only its usage is wanted; the chunk passes back as it is
            if end:
                self.usage = self._relay.usage
            return
        if len(self._body) + len(chunk) <= _USAGE_BODY_BYTES:
            self._body += chunk
        if end and self.status.isdigit():
            self.usage = read_usage(int(self.status), bytes(self._body))


# Requests other than completions that the EPP lets through to a worker with the worker token:
# the rest of the client API the HTTP gateway serves. Any other path (`/kv/snapshot`,
# `/kvgate/assets`, `/reset_prefix_cache`, LoRA loading, ...) goes on without the token, and a
# worker that has one refuses it: a client must not reach those through the proxy.
_OPEN_BY_LOAD = frozenset({("GET", "/v1/models")})


def _to_worker(st: GatewayState) -> dict[str, str]:
    """Headers the proxy must forward to the worker: the worker token (docs/security.md), which
    also replaces any client credential, so a tenant's API key never reaches a worker."""
    token = st.config.worker_token
    return {"authorization": bearer(token)} if token else {}
