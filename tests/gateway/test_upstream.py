"""The gateway's HTTP/1.1 client for forwarding, against a real asyncio HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import uvloop

from gateway.upstream.pool import UpstreamError, UpstreamPool, UpstreamTimeout
from harness.ports import HOST, free_port


class Server:
    """Answers each POST by `mode`; counts connections; can close idle ones."""

    def __init__(self, mode: str = "echo") -> None:
        self.mode = mode
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.close_idle()
        self.server.close()

    def close_idle(self) -> None:
        for w in self.writers:
            w.close()
        self.writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                body = await reader.readexactly(length)
                if not await self._answer(head, body, writer):
                    break
        writer.close()

    async def _answer(self, head: bytes, body: bytes, w: asyncio.StreamWriter) -> bool:
        if self.mode == "slow":
            await asyncio.sleep(5)
        if self.mode == "stream":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
            w.write(b"transfer-encoding: chunked\r\n\r\n")
            for i in range(3):
                data = b"data: %d\n\n" % i
                w.write(b"%x\r\n%s\r\n" % (len(data), data))
                await w.drain()
                await asyncio.sleep(0.05)
            w.write(b"0\r\n\r\n")
            return True
        if self.mode == "big":
            body = b"x" * (3 << 20)  # past the client's back-pressure mark
        close = self.mode == "close"
        extra = b"connection: close\r\n" if close else b""
        path = head.split(b" ")[1]
        out = path + b" " + body
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
            % (extra, len(out), out)
        )
        await w.drain()
        return not close


def _pool(port: int, read_timeout: float = 5.0) -> UpstreamPool:
    return UpstreamPool(f"http://{HOST}:{port}", connect_timeout=2.0, read_timeout=read_timeout)


def test_keep_alive_reuses_one_connection() -> None:
    async def scenario() -> None:
        async with Server() as s:
            pool = _pool(s.port)
            for i in range(3):
                resp = await pool.post("/v1/x", b'{"i": %d}' % i)
                assert resp.status == 200 and resp.content_type == "application/json"
                assert await resp.read() == b'/v1/x {"i": %d}' % i
            assert s.connections == 1
            await pool.close()

    asyncio.run(scenario())


def test_idle_connection_closed_by_the_worker_is_replaced() -> None:
    async def scenario() -> None:
        async with Server() as s:
            pool = _pool(s.port)
            assert await (await pool.post("/a", b"1")).read() == b"/a 1"
            s.close_idle()  # what a worker's keep-alive timeout does
            await asyncio.sleep(0.05)
            assert await (await pool.post("/b", b"2")).read() == b"/b 2"
            assert s.connections == 2
            await pool.close()

    asyncio.run(scenario())


def test_connection_close_answer_is_not_reused() -> None:
    async def scenario() -> None:
        async with Server("close") as s:
            pool = _pool(s.port)
            for _ in range(2):
                assert await (await pool.post("/a", b"1")).read() == b"/a 1"
            assert s.connections == 2
            await pool.close()

    asyncio.run(scenario())


def test_chunked_stream_arrives_chunk_by_chunk() -> None:
    async def scenario() -> None:
        async with Server("stream") as s:
            pool = _pool(s.port)
            resp = await pool.post("/s", b"{}")
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            chunks = [c async for c in resp.iter_raw()]
            assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            assert len(chunks) >= 2  # passed on as they came, not buffered to the end
            resp.close()
            assert await (await pool.post("/s", b"{}")).read()  # the connection is reusable
            assert s.connections == 1
            await pool.close()

    asyncio.run(scenario())


def test_a_connection_lost_before_the_request_is_an_upstream_error() -> None:
    """A worker killed just after accepting: the connection is gone by the time the request is
    written. Under uvloop (the gateway's loop) a write to the closed transport would raise a
    RuntimeError, a 500; it must be an UpstreamError, which the gateway retries elsewhere."""

    async def scenario() -> None:
        async with Server() as s:
            pool = _pool(s.port)
            conn = await pool._connect()
            while s.connections == 0:
                await asyncio.sleep(0.01)
            s.close_idle()  # the worker's side goes away before anything is sent
            while not conn.lost:
                await asyncio.sleep(0.01)
            with pytest.raises(UpstreamError, match="before the request was sent"):
                await pool._send(conn, b"POST /a HTTP/1.1\r\ncontent-length: 2\r\n\r\n", b"{}")
            await pool.close()

    uvloop.run(scenario())


def test_refused_and_silent_workers_raise() -> None:
    async def scenario() -> None:
        with pytest.raises(UpstreamError, match="connect failed"):
            await _pool(free_port()).post("/a", b"{}")
        async with Server("slow") as s:
            pool = _pool(s.port, read_timeout=0.2)
            with pytest.raises(UpstreamTimeout):
                await pool.post("/a", b"{}")
            await pool.close()

    asyncio.run(scenario())


def test_large_answer_read_whole_and_large_stream_drained() -> None:
    async def scenario() -> None:
        async with Server("big") as s:
            pool = _pool(s.port, read_timeout=5.0)
            body = await (await pool.post("/big", b"{}")).read()
            assert body == b"/big " + b"x" * (3 << 20)
            resp = await pool.post("/big", b"{}")
            await asyncio.sleep(0.2)  # the answer arrives while nobody reads: reading pauses
            got = b"".join([c async for c in resp.iter_raw()])
            assert len(got) == len(body)
            resp.close()
            assert s.connections == 1
            await pool.close()

    asyncio.run(scenario())
