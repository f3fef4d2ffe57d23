"""The request body as the proxy sends it: its body mode, and the body messages as they come.

The proxy's `protocol_config` (on the stream's first message) names its request body mode,
which decides how the EPP answers (gateway/epp/stream.py, its docstring): full duplex, streamed
with the body sent early, buffered, streamed (asked to buffer), or no body at all.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from . import wire

log = logging.getLogger(__name__)

MODE_NAMES = {v: k for k, v in ProcessingMode.BodySendMode.items()}
# How the request phase is answered (module docstring), from the proxy's request body mode.
DUPLEX, EARLY, BUFFERED, STREAMED, NO_BODY = (
    "full duplex",
    "streamed, body sent early",
    "buffered",
    "streamed",
    "no body",
)
_STREAMED_WARNED = False


def request_style(first) -> str:
    req, _ = wire.body_modes(first)
    if req is None or req == ProcessingMode.FULL_DUPLEX_STREAMED:
        return DUPLEX
    if req == ProcessingMode.STREAMED:
        early = first.protocol_config.send_body_without_waiting_for_header_response
        return EARLY if early else STREAMED
    if req in (ProcessingMode.BUFFERED, ProcessingMode.BUFFERED_PARTIAL):
        return BUFFERED
    return NO_BODY  # NONE (or GRPC): the proxy sends no body to pick on


class ProtocolError(Exception):
    """The proxy sent messages out of the protocol's order."""


class BodySource:
    """The request as `read_request` reads it: headers, and the body messages as they come."""

    def __init__(self, headers: Mapping[str, str], messages: AsyncIterator, ended: bool) -> None:
        self.headers = headers
        self._messages = messages
        self.ended = ended  # the headers carried end_of_stream: no body
        self.trailers = False
        self.count = 0  # body messages received: each is answered once outside full duplex

    async def stream(self) -> AsyncIterator[bytes]:
        while not self.ended:
            msg = await anext(self._messages, None)
            kind = msg.WhichOneof("request") if msg is not None else None
            if kind == "request_body":
                self.count += 1
                self.ended = msg.request_body.end_of_stream
                yield msg.request_body.body
            elif kind == "request_trailers":
                self.ended = self.trailers = True
            else:
                raise ProtocolError(f"expected the request body, got {kind or 'the stream end'}")


def warn_streamed() -> None:
    global _STREAMED_WARNED
    if not _STREAMED_WARNED:
        _STREAMED_WARNED = True
        log.warning(
            "the proxy sends request bodies STREAMED and kept that mode: it routes each request "
            "on its headers, so kvgate picks by load, not by cache. Set allow_mode_override: "
            "true on its ext_proc filter (or use FULL_DUPLEX_STREAMED or BUFFERED)"
        )
