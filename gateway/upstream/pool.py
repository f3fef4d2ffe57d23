"""A lean HTTP/1.1 client for the request path: pooled keep-alive connections to one worker.

The gateway sends one kind of request on its hot path, a JSON POST to a worker it knows. httpx
spent most of the gateway's CPU per proxied request (profiled, docs/benchmarks.md), so this
path uses asyncio connections with httptools' parser (already uvicorn's). Control traffic
(polls, snapshots, assets) stays on httpx.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.upstream.connection import (
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    WorkerConnection,
)

__all__ = ["Fetched", "UpstreamError", "UpstreamPool", "UpstreamResponse", "UpstreamTimeout"]


@dataclass(frozen=True, slots=True)
class Fetched:
    """A whole answer to a GET: its status and body (the pollers' documents)."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class UpstreamPool:
    """Keep-alive connections to one worker base URL (http or https)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
        max_idle: int = 64,
        authorization: str | None = None,
    ) -> None:
        self.url = url
        u = urlsplit(url)
        self.https = u.scheme == "https"
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if self.https else 80)
        self.base_path = u.path.rstrip("/").encode()
        self._host_header = u.netloc.encode()
        # The worker token (docs/security.md), on every request to this worker.
        self._auth = b"Authorization: %s\r\n" % authorization.encode() if authorization else b""
        self._ssl = (ssl_context or ssl.create_default_context()) if self.https else None
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self._idle: list[WorkerConnection] = []
        self._open: set[WorkerConnection] = set()

    async def post(self, path: str, body: bytes, extra_headers: bytes = b"") -> UpstreamResponse:
        """POST a JSON body; returns once the status line and headers are in."""
        head = (
            b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s%s\r\n"
            % (
                self.base_path,
                path.encode(),
                self._host_header,
                len(body),
                self._auth,
                extra_headers,
            )
        )
        return await self._request(head, body)

    async def get(self, path: str) -> UpstreamResponse:
        """GET `path` (the pollers' /health, /metrics, /kvgate/info) on a kept-alive connection."""
        head = b"GET %s%s HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (
            self.base_path,
            path.encode(),
            self._host_header,
            self._auth,
        )
        return await self._request(head, b"")

    async def fetch(self, path: str) -> Fetched:
        """GET `path` and read the whole answer."""
        resp = await self.get(path)
        return Fetched(resp.status, await resp.read())

    async def _request(self, head: bytes, body: bytes) -> UpstreamResponse:
        while self._idle:
            conn = self._idle.pop()
            try:
                return await self._send(conn, head, body)
            except UpstreamTimeout:
                raise
            except UpstreamError:
                continue  # an idle connection the worker closed meanwhile: take the next one
        return await self._send(await self._connect(), head, body)

    async def _connect(self) -> WorkerConnection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: WorkerConnection(self), self.host, self.port, ssl=self._ssl
                ),
                self.connect_timeout,
            )
        except (OSError, TimeoutError) as e:
            raise UpstreamError(f"connect failed: {type(e).__name__}: {e}") from e
        self._open.add(conn)
        return conn

    async def _send(self, conn: WorkerConnection, head: bytes, body: bytes) -> UpstreamResponse:
        assert conn.transport is not None
        if conn.lost or conn.transport.is_closing():
            # The worker closed it between the connect and now (a worker killed just after it
            # accepted): uvloop raises on a write to a closed transport. Nothing was sent.
            raise UpstreamError("connection closed before the request was sent")
        resp = conn.resp = UpstreamResponse(conn)
        if len(body) < 65536:
            conn.transport.write(head + body)
        else:
            conn.transport.writelines((head, body))
        try:
            while not resp._headers_done:
                await resp._wait(self.read_timeout)
        except BaseException:
            resp.close()  # mid-answer (or cancelled): the connection cannot be reused
            raise
        return resp

    def put_back(self, conn: WorkerConnection) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            self.forget(conn)
            if conn.transport is not None:
                conn.transport.close()

    def forget(self, conn: WorkerConnection) -> None:
        self._open.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    async def close(self) -> None:
        for conn in list(self._open):
            if conn.transport is not None:
                conn.transport.close()
        self._open.clear()
        self._idle.clear()
