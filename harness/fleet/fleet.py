"""Fleet: N simulated replicas in one process, each on its own HTTP port and event sockets."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from harness.fleet.engine import Timing
from harness.fleet.events import FleetZmq, cancel
from harness.fleet.http_server import serve
from harness.fleet.model import FleetModel
from harness.fleet.replica import SimReplica


@dataclass(frozen=True, slots=True)
class FleetConfig:
    replicas: int
    num_blocks: int
    timing: Timing = field(default_factory=Timing)
    host: str = "127.0.0.1"
    model: str = "demo"
    served_model_name: str = "demo"
    block_size: int = 16
    events_buffer: int = 10_000  # batches each replica keeps for replay

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("replicas, num_blocks and block_size must be positive")
        if self.events_buffer < 1:
            raise ValueError("events_buffer must be positive")


class Fleet:
    """`async with Fleet(config) as fleet: fleet.urls`: every replica listening."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.model = FleetModel.load(config.model, config.served_model_name, config.block_size)
        self.replicas: list[SimReplica] = []
        self._zmq = FleetZmq(config.replicas)
        self._servers: list[asyncio.Server] = []
        self._tasks: list[asyncio.Task] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.config.host}:{r.port}" for r in self.replicas]

    async def start(self) -> Fleet:
        c = self.config
        try:
            for _ in range(c.replicas):
                rep = SimReplica(
                    self.model, self._zmq, c.host, c.num_blocks, c.timing, c.events_buffer
                )
                self.replicas.append(rep)
                server = await serve(c.host, 0, rep.handle)
                self._servers.append(server)
                rep.listening(server.sockets[0].getsockname()[1])
                self._tasks.append(asyncio.create_task(rep.events.serve_replay()))
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for task in self._tasks:
            await cancel(task)
        for rep in self.replicas:
            rep.events.close()
        with contextlib.suppress(Exception):
            self._zmq.close()

    async def __aenter__(self) -> Fleet:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
