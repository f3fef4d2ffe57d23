"""One request down the shared path, whichever entry point took it: `Exchange`.

HTTP (gateway/http/serving.py) calls `answer`: read -> route -> decide -> send with retries ->
the answer, read whole or (a stream) handed back for the relay. The EPP (gateway/epp/stream.py)
calls `route`: read -> route -> decide, and the proxy forwards the request itself. Either way the
request ends once, in `end`, whatever stage it reached; `status` there is the HTTP status the
client got, or `client_gone`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping

from cachekey.headers import (
    PREDICTED_CPU_HEADER,
    PREDICTED_GPU_HEADER,
    PREDICTED_HEADER,
    REPLICA_HEADER,
)
from cachekey.openai.protocol import OpenAIRequest
from gateway import accounting
from gateway.names import ReplicaId
from gateway.routing.policy_choice import policy_label
from gateway.routing.request import ProxyRequest
from gateway.serving.read import RequestSource, read_request
from gateway.serving.retry import send_with_retries
from gateway.state import GatewayState
from gateway.upstream.pool import UpstreamResponse

Answer = tuple[UpstreamResponse, bytes | None]  # content None: a stream, for the relay


class Exchange:
    __slots__ = ("ended", "headers", "held", "px", "state")

    def __init__(self, state: GatewayState, headers: Mapping[str, str]) -> None:
        self.state = state
        self.headers = headers
        self.px: ProxyRequest | None = None  # set once routed
        self.ended = False
        # The body's bytes in `--body-read-budget` until the request has a slot (or ends): the
        # bodies waiting in the admission queue are bounded with those being read.
        self.held = 0

    async def answer(
        self,
        source: RequestSource,
        endpoint: str,
        model_cls: type[OpenAIRequest],
        proxy_cls: type[ProxyRequest],
        guard: Callable[[Awaitable[Answer]], Awaitable[Answer | None]],
    ) -> Answer | None:
        """The worker's answer: read whole, or a stream (content None) for the caller to relay.
        `guard` runs what follows the body's reading (decide, send), and gives None when the
        client left meanwhile (gateway/http/disconnect.py)."""
        body, tenant, self.held = await read_request(self.state, source, model_cls)
        await self._started()
        px = self.px = proxy_cls.route(self.state, endpoint, body, self.headers, tenant=tenant)
        return await guard(self._send(px, bool(body.stream)))

    async def route(
        self,
        source: RequestSource,
        endpoint: str,
        model_cls: type[OpenAIRequest],
        subset: Callable[[], Collection[ReplicaId] | None],
    ) -> ProxyRequest:
        """read -> route -> decide: the request routed, its lease taken. `subset`, asked once
        the body is read, is the only replicas it may go to (an EPP's proxy can name them)."""
        body, tenant, self.held = await read_request(self.state, source, model_cls)
        try:  # however it ends here (a refusal, a cancelled stream), the body is given back
            await self._started()
            px = self.px = ProxyRequest.route(
                self.state, endpoint, body, self.headers, tenant=tenant, subset=subset()
            )
            await px.decide()
        finally:
            self._give_body_back()
        return px

    async def _started(self) -> None:
        """A gateway that has not polled its workers yet (just started) holds the request for
        those polls, `--start-wait` s at most; after that one attribute read."""
        replicas = self.state.replicas
        if not replicas.started:
            await replicas.wait_started(self.state.config.start_wait)

    async def _send(self, px: ProxyRequest, stream: bool) -> Answer:
        await px.decide()
        self._give_body_back()
        resp = await send_with_retries(px, px.payload())
        if stream and resp.status == 200:
            return resp, None
        try:
            return resp, await resp.read()
        finally:
            resp.close()  # a no-op once read; if cancelled, drops the connection: the worker stops

    def end(self, status: str, usage: dict | None = None) -> None:
        """The one place a request ends, in both modes, whatever stage it reached: a routed
        request gives its slot back and records its outcome (`ProxyRequest.release`); one
        refused before it was routed (auth, parse, limits, unknown model or policy, no replica)
        is counted as the gateway's own answer. Only the first call counts."""
        if self.ended:
            return
        self.ended = True
        self._give_body_back()
        if self.px is not None:
            self.px.release(status, usage)
        else:
            accounting.answered_here(self.state, policy_label(self.state, self.headers), status)

    def _give_body_back(self) -> None:
        if self.held:
            self.state.bodies.give(self.held)
            self.held = 0

    def replica_headers(self, status: int) -> dict[str, str]:
        """The response headers naming the replica and, for an answer it served (not a refusal),
        its predicted cached tokens, in all and per tier (both modes)."""
        assert self.px is not None
        lease = self.px.lease
        assert lease.replica is not None
        if status >= 400:
            return {REPLICA_HEADER: lease.replica.name}
        return {
            REPLICA_HEADER: lease.replica.name,
            PREDICTED_HEADER: str(lease.predicted),
            PREDICTED_GPU_HEADER: str(lease.predicted - lease.predicted_host),
            PREDICTED_CPU_HEADER: str(lease.predicted_host),
        }
