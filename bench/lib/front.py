"""A tiny round-robin TCP front on 127.0.0.1: several gateways behind one address, as a
Kubernetes Service (L4, per connection) puts them. Runs its own event loop in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Sequence

from harness.ports import HOST, free_port


class RoundRobinFront:
    """`with RoundRobinFront([url, ...]) as front: front.url`: each new connection goes to the
    next backend in turn, and its bytes are piped both ways until either side closes."""

    def __init__(self, backends: Sequence[str]) -> None:
        self.backends = [(HOST, int(u.rsplit(":", 1)[1])) for u in backends]
        self.port = free_port()
        self._next = itertools.cycle(self.backends)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> RoundRobinFront:
        self._thread.start()
        start = asyncio.start_server(self._serve, HOST, self.port)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        host, port = next(self._next)
        try:
            up_r, up_w = await asyncio.open_connection(host, port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
