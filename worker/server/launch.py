"""Start a worker's engine cores before its API server: one core process per data-parallel
rank, each loading its own engine and binding its own KV-event ports (core_process.py). The API
server imports its web stack while they load (`spawn_worker_cores`, then `wait`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import zmq

from cachekey.events import topic
from cachekey.render import RenderLimits
from worker.engine.config import EngineConfig
from worker.server.config import ServerConfig
from worker.server.core_process import CoreHandle, StartingCore, await_cores, spawn_cores
from worker.server.kv_publisher import PublisherConfig


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


@dataclass
class StartingWorkerCores:
    """The cores started, loading their engines while the API server starts too."""

    starting: list[StartingCore]
    identity: tuple[str, str]
    ctx: zmq.Context
    limits: RenderLimits  # the API server's renderer's (--max-image-* flags)

    def wait(self) -> Cores:
        """Raises CoreStartError (a ValueError) with the core's own message when one cannot
        load; every core is stopped then."""
        try:
            handles = await_cores(self.starting, self.limits)
        except BaseException:
            self.ctx.term()
            raise
        return Cores(handles, self.identity, self.ctx)

    def abandon(self) -> None:
        """Kill them all (the API server could not start)."""
        for core in self.starting:
            core.abandon()
        self.ctx.term()


def spawn_worker_cores(engine: EngineConfig, server: ServerConfig) -> StartingWorkerCores:
    """Start the worker's cores and return at once: `wait()` for them to load."""
    assert engine.served_model_name is not None  # EngineConfig fills it in
    identity = new_identity(engine.served_model_name)
    ctx = zmq.Context()
    try:
        starting = spawn_cores(
            ctx,
            [(engine, p) for p in publisher_configs(server, identity[1])],
            fault_injection=server.enable_fault_injection,
            log_level=server.log_level,
        )
    except BaseException:
        ctx.term()
        raise
    return StartingWorkerCores(starting, identity, ctx, server.render_limits())


def new_identity(model_name: str) -> tuple[str, str]:
    """A new instance id and its KV-event topic (one for every rank, as vLLM's); the cores'
    publishers need the topic before the app state exists."""
    instance_id = uuid.uuid4().hex
    return instance_id, topic(instance_id, model_name)


def publisher_configs(config: ServerConfig, kv_topic: str) -> list[PublisherConfig | None]:
    """Each engine's publisher (None: KV events disabled), started in its core process."""
    if not config.events_enabled:
        return [None] * len(config.engine_ranks())
    replay = config.kv_events_replay_port
    return [
        PublisherConfig(
            host=config.zmq_host,
            port=config.kv_events_port + i,
            replay_port=replay + i if replay else None,
            topic=kv_topic,
            buffer_size=config.kv_events_buffer,
            data_parallel_rank=rank,
            curve=config.curve_keys,
        )
        for i, rank in enumerate(config.engine_ranks())
    ]
