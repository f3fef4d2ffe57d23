"""A Kubernetes Service in front of gateway pods, as kube-proxy makes one (for rollout tests).

Each new TCP connection goes to one of the current endpoints, round robin; it stays with that
endpoint until either side closes it (the other side is then closed too). Taking an endpoint
out, as the endpoints controller does for a pod being deleted, only stops new connections
from reaching it. Runs on the caller's event loop, on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib

from harness.ports import HOST, free_port


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except OSError:
        pass
    finally:
        dst.close()


class ServiceFront:
    def __init__(self) -> None:
        self.port = free_port()
        self.endpoints: list[int] = []  # ports of the ready gateways
        self.connections: dict[int, int] = {}  # endpoint port -> connections sent there
        self._next = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _pick(self) -> int | None:
        if not self.endpoints:
            return None
        self._next += 1
        return self.endpoints[self._next % len(self.endpoints)]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = self._pick()
        try:
            if port is None:
                raise ConnectionRefusedError("no ready endpoint")
            up_reader, up_writer = await asyncio.open_connection(HOST, port)
        except OSError:
            writer.close()  # the client sees its connection closed, as with no endpoint
            return
        self.connections[port] = self.connections.get(port, 0) + 1
        with contextlib.suppress(OSError):
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
