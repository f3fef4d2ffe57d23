"""create_app: the worker's FastAPI app; all of its state is built here, in one place."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import xxhash
from fastapi import FastAPI

from cachekey.events import topic
from worker.engine.llm_engine import LLMEngine
from worker.server.config import ServerConfig
from worker.server.engine_client import AsyncEngine
from worker.server.errors import install_error_handlers
from worker.server.kv_publisher import KVEventPublisher, PublisherConfig
from worker.server.metrics import WorkerMetrics
from worker.server.serving import ServingContext
from worker.server.serving_chat import ServingChat
from worker.server.serving_completion import ServingCompletion

logger = logging.getLogger(__name__)

_WATCHDOG_S = 0.5


@dataclass(slots=True)
class AppState:
    config: ServerConfig
    engine: AsyncEngine
    publisher: KVEventPublisher | None
    metrics: WorkerMetrics
    instance_id: str
    model_name: str
    model_path: str
    max_model_len: int
    topic: str
    info: dict
    chat: ServingChat
    completion: ServingCompletion


def fingerprint_parts(engine: LLMEngine) -> dict[str, str | int]:
    """Everything that determines block keys; two workers match iff these match."""
    ns = engine.namespace
    return {
        **engine.assets.fingerprint_parts(),
        "assets": engine.assets.fingerprint(),
        "block_size": ns.block_size,
        "hash_seed": ns.seed,
        "namespace_model": ns.model,
    }


def build_state(engine: LLMEngine, config: ServerConfig) -> AppState:
    instance_id = uuid.uuid4().hex
    model_name = engine.config.served_model_name
    kv_topic = topic(instance_id, model_name)
    publisher = None
    if config.events_enabled:
        publisher = KVEventPublisher(
            PublisherConfig(
                host=config.zmq_host,
                port=config.kv_events_port,
                replay_port=config.kv_events_replay_port or None,
                topic=kv_topic,
                buffer_size=config.kv_events_buffer,
                data_parallel_rank=config.data_parallel_rank,
            )
        )
    async_engine = AsyncEngine(engine, publisher, stall_timeout_s=config.engine_stall_timeout_s)
    stats = engine.stats()
    metrics = WorkerMetrics(
        async_engine.stats,
        model_name,
        block_size=stats.block_size,
        num_gpu_blocks=stats.num_blocks,
        enable_prefix_caching=engine.config.enable_prefix_caching,
    )
    max_model_len = engine.max_model_len
    parts = fingerprint_parts(engine)
    info = {
        "model": model_name,
        "model_path": str(engine.config.model),
        "block_size": engine.namespace.block_size,
        "hash_seed": engine.namespace.seed,
        "fingerprint": xxhash.xxh3_128_hexdigest(json.dumps(parts, sort_keys=True).encode()),
        "fingerprint_parts": parts,
        "instance_id": instance_id,
        "data_parallel_rank": config.data_parallel_rank,
        "engine": engine.config.engine,
        "max_model_len": max_model_len,
        "num_blocks": stats.num_blocks,
        "kv_events": {
            "enabled": config.events_enabled,
            "port": config.kv_events_port or None,
            "replay_port": (config.kv_events_replay_port or None)
            if config.events_enabled
            else None,
            "topic": kv_topic,
        },
    }
    ctx = ServingContext(
        async_engine, model_name, max_model_len, metrics, config.data_parallel_rank
    )
    return AppState(
        config=config,
        engine=async_engine,
        publisher=publisher,
        metrics=metrics,
        instance_id=instance_id,
        model_name=model_name,
        model_path=str(engine.config.model),
        max_model_len=max_model_len,
        topic=kv_topic,
        info=info,
        chat=ServingChat(ctx),
        completion=ServingCompletion(ctx),
    )


async def _watchdog(engine: AsyncEngine) -> None:
    # Requests already waiting on a stalled engine would hang forever: fail them.
    while True:
        await asyncio.sleep(_WATCHDOG_S)
        health = engine.health()
        if not health.ok:
            engine.fail_all_pending(health.reason or "engine unavailable")


def create_app(
    engine: LLMEngine,
    config: ServerConfig,
    *,
    on_ready: Callable[[AppState], None] | None = None,
) -> FastAPI:
    from worker.server.api_router import attach_routes
    from worker.server.compat import attach_compat_routes

    state = build_state(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if state.publisher is not None:
            state.publisher.start()
        state.engine.start(asyncio.get_running_loop())
        watchdog = asyncio.create_task(_watchdog(state.engine))
        if on_ready is not None:
            on_ready(state)
        try:
            yield
        finally:
            watchdog.cancel()
            state.engine.shutdown()
            if state.publisher is not None:
                state.publisher.close()

    app = FastAPI(title="kvgate worker", lifespan=lifespan)
    app.state.kvgate = state
    install_error_handlers(app)
    attach_routes(app, state)
    attach_compat_routes(app, state)
    return app
