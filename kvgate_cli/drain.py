"""Graceful shutdown of `python -m gateway` and `python -m worker`: what a rollout's SIGTERM does.

At once the listening sockets close (so readiness fails: the chart's probe is refused) and idle
keep-alive connections close. Requests and streams in flight then have `--drain-timeout` seconds
to finish. A stream still open when that passes is cut the way a client can read: it gets an SSE
error event (`server_shutting_down`) and `data: [DONE]`, its server counts it, and one log line
says how many were cut. Only then does uvicorn's own bound (a little later) cancel what is left,
so a drain that cuts streams does not end in uvicorn's cancellation traceback.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import uvicorn

log = logging.getLogger("kvgate.drain")

# What a cut stream's error event says (its `code`), in the gateway's and the worker's answers.
SHUTTING_DOWN = "server_shutting_down"
# Seconds past --drain-timeout that uvicorn waits before cancelling: the cut streams' last events
# are written and their connections closed in this time.
_CUT_GRACE_S = 2.0


class OpenStreams:
    """The streams a server has open, each with how to cut it (its error event, then its end)."""

    def __init__(self) -> None:
        self._cuts: dict[int, Callable[[str], None]] = {}
        self._next = 0
        self.cut_total = 0  # streams cut by a drain, for the log line and the metric

    def add(self, cut: Callable[[str], None]) -> int:
        """Register an open stream; `cut(reason)` must make it end with an error event."""
        self._next += 1
        self._cuts[self._next] = cut
        return self._next

    def discard(self, handle: int) -> None:
        self._cuts.pop(handle, None)

    def __len__(self) -> int:
        return len(self._cuts)

    def cut_all(self, reason: str) -> int:
        """Cut every open stream; how many there were."""
        cuts, self._cuts = list(self._cuts.values()), {}
        for cut in cuts:
            cut(reason)
        self.cut_total += len(cuts)
        return len(cuts)


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown (on SIGTERM or SIGINT) drains: `on_drain` runs first (the
    EPP's own drain), then in-flight work has `drain_timeout` s, then open streams are cut."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        streams: OpenStreams,
        drain_timeout: float,
        on_drain: Callable[[], None] = lambda: None,
    ) -> None:
        config.timeout_graceful_shutdown = drain_timeout + _CUT_GRACE_S
        super().__init__(config)
        self.streams = streams
        self.drain_timeout = drain_timeout
        self.on_drain = on_drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.info(
            "draining: no new connections; requests in flight get %gs (--drain-timeout)",
            self.drain_timeout,
        )
        self.on_drain()
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self._cut)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _cut(self) -> None:
        reason = f"the server is shutting down: --drain-timeout {self.drain_timeout:g}s passed"
        n = self.streams.cut_all(reason)
        log.warning(
            "drain: --drain-timeout %gs passed: cut %d open stream(s), each with an SSE error "
            "event (%s)",
            self.drain_timeout,
            n,
            SHUTTING_DOWN,
        )
