"""A relayed stream releases its replica slot even when the client left before the first byte."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from starlette.requests import ClientDisconnect

from gateway.http.sse_relay import RelayResponse

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "headers": []}


class Tracker:
    def __init__(self) -> None:
        self.started = False
        self.ended: list[str] = []

    async def stream(self) -> AsyncIterator[bytes]:
        self.started = True
        try:
            yield b"data: 1\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self.end("done")

    def end(self, status: str) -> None:
        if not self.ended:  # idempotent, as the gateway's on_end is
            self.ended.append(status)

    async def on_close(self) -> None:
        self.end("client_gone")


async def _receive() -> dict:
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


def test_client_gone_before_first_byte_still_ends_the_stream() -> None:
    t = Tracker()

    async def send(_message: dict) -> None:
        raise OSError("client went away")  # what uvicorn raises for a closed connection

    resp = RelayResponse(t.stream(), t.on_close, media_type="text/event-stream")
    with pytest.raises(ClientDisconnect):
        asyncio.run(resp(SCOPE, _receive, send))
    assert not t.started  # the generator never ran, so only on_close could release the slot
    assert t.ended == ["client_gone"]


def test_normal_stream_ends_exactly_once() -> None:
    t = Tracker()
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    resp = RelayResponse(t.stream(), t.on_close, media_type="text/event-stream")
    asyncio.run(resp(SCOPE, _receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert body == b"data: 1\n\ndata: [DONE]\n\n"
    assert t.ended == ["done"]
