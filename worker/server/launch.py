"""Start a worker's engine cores before its API server: one core process per data-parallel
rank, each loading its own engine and binding its own KV-event ports (core_process.py)."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from worker.engine.config import EngineConfig
from worker.server.app_state import new_identity, publisher_configs
from worker.server.config import ServerConfig
from worker.server.core_process import CoreHandle, start_cores


@dataclass
class Cores:
    """The started cores, the worker's identity (instance id, KV-event topic), and the ZMQ
    context their sockets live in."""

    handles: list[CoreHandle]
    identity: tuple[str, str]
    ctx: zmq.Context

    def stop(self) -> None:
        """Stop the cores and end the context; a second call does nothing."""
        if self.ctx.closed:
            return
        for core in self.handles:
            core.stop()
        self.ctx.term()


def start_worker_cores(engine: EngineConfig, server: ServerConfig) -> Cores:
    """Raises CoreStartError (a ValueError) with the core's own message when one cannot load."""
    assert engine.served_model_name is not None  # EngineConfig fills it in
    identity = new_identity(engine.served_model_name)
    ctx = zmq.Context()
    try:
        handles = start_cores(
            ctx,
            [(engine, p) for p in publisher_configs(server, identity[1])],
            fault_injection=server.enable_fault_injection,
            log_level=server.log_level,
        )
    except BaseException:
        ctx.term()
        raise
    return Cores(handles, identity, ctx)
