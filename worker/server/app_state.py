"""WorkerState: everything the worker's routes use, built once by `init_app_state`.

Routes reach it through `request.app.state` (`worker_state(request)`); nothing here imports a
router or the app module.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import msgspec
from fastapi import Request
from starlette.datastructures import State

from cachekey.documents import (
    AssetFiles,
    FingerprintParts,
    KVEventsEndpoint,
    LoRAAdapters,
    WorkerInfo,
)
from cachekey.events import topic
from worker.engine.llm_engine import LLMEngine
from worker.engine.outputs import LoRAStats
from worker.server.config import ServerConfig
from worker.server.engine_client import AsyncEngine
from worker.server.faults import DroppingKVEventPublisher, FaultInjector
from worker.server.kv_publisher import (
    EventPublisher,
    KVEventPublisher,
    NullEventPublisher,
    PublisherConfig,
)
from worker.server.metrics import WorkerMetrics
from worker.server.serving import ServingContext
from worker.server.serving_chat import ServingChat
from worker.server.serving_completion import ServingCompletion
from worker.server.serving_embedding import ServingEmbedding


@dataclass(frozen=True, slots=True)
class WorkerState:
    config: ServerConfig
    info: WorkerInfo
    engine: AsyncEngine
    publisher: EventPublisher
    metrics: WorkerMetrics
    chat: ServingChat
    completion: ServingCompletion
    embedding: ServingEmbedding
    assets: AssetFiles
    max_num_seqs: int
    created: int  # the model card's `created`
    faults: FaultInjector | None  # only with --enable-fault-injection


def worker_state(request: Request) -> WorkerState:
    return request.app.state.worker


def init_app_state(state: State, engine: LLMEngine, config: ServerConfig) -> WorkerState:
    """Build the worker's state around a loaded engine and store it on `state` (once)."""
    instance_id = uuid.uuid4().hex
    model_name = engine.config.served_model_name
    assert model_name is not None  # EngineConfig fills it in
    kv_topic = topic(instance_id, model_name)
    publisher = _publisher(config, kv_topic)
    async_engine = AsyncEngine(engine, publisher, stall_timeout_s=config.engine_stall_timeout_s)
    info = worker_info(engine, config, instance_id, kv_topic)
    metrics = WorkerMetrics(
        async_engine.stats,
        model_name,
        block_size=info.block_size,
        num_gpu_blocks=engine.stats().num_blocks,
        enable_prefix_caching=engine.config.enable_prefix_caching,
    )
    ctx = ServingContext(
        async_engine,
        engine.renderer,
        model_name,
        engine.max_model_len,
        metrics,
        config.data_parallel_rank,
        hidden_layers=engine.runner.hidden.row_layers,
    )
    faults = FaultInjector(async_engine, publisher) if config.enable_fault_injection else None
    worker = WorkerState(
        config=config,
        info=info,
        engine=async_engine,
        publisher=publisher,
        metrics=metrics,
        chat=ServingChat(ctx),
        completion=ServingCompletion(ctx),
        embedding=ServingEmbedding(ctx, json.loads(engine.assets.files.get("config.json", b"{}"))),
        assets=AssetFiles(dict(engine.assets.files)),
        max_num_seqs=engine.config.max_num_seqs,
        created=int(time.time()),
        faults=faults,
    )
    if getattr(state, "worker", None) is not None:
        raise RuntimeError("the worker's app state is already initialized")
    state.worker = worker
    return worker


def worker_info(
    engine: LLMEngine, config: ServerConfig, instance_id: str, kv_topic: str
) -> WorkerInfo:
    """What `/kvgate/info` says: how this worker keys blocks and where its events are."""
    ns = engine.namespace
    parts = FingerprintParts(
        **engine.assets.fingerprint_parts(),
        assets=engine.assets.fingerprint(),
        block_size=ns.block_size,
        hash_seed=ns.seed,
        namespace_model=ns.model,
    )
    events = config.events_enabled
    return WorkerInfo(
        model=ns.model,
        model_path=str(engine.config.model),
        block_size=ns.block_size,
        hash_seed=ns.seed,
        fingerprint=parts.digest(),
        fingerprint_parts=parts,
        instance_id=instance_id,
        data_parallel_rank=config.data_parallel_rank,
        engine=engine.config.engine,
        max_model_len=engine.max_model_len,
        num_blocks=engine.stats().num_blocks,
        defers_shared_prefill=engine.config.enable_prefix_caching,
        kv_events=KVEventsEndpoint(
            enabled=events,
            port=config.kv_events_port or None,
            replay_port=(config.kv_events_replay_port or None) if events else None,
            topic=kv_topic,
            curve=events and config.worker_token is not None,
        ),
    )


def current_info(state: WorkerState) -> WorkerInfo:
    """The worker's info with its LoRA adapters as the engine thread last recorded them."""
    lora = state.engine.stats().lora
    if lora is None:
        return state.info
    return msgspec.structs.replace(state.info, lora=lora_adapters(lora))


def lora_adapters(lora: LoRAStats) -> LoRAAdapters:
    return LoRAAdapters(
        max_loras=lora.max_loras,
        adapters=[name for name, _ in lora.adapters],
        resident=list(lora.resident),
        max_lora_rank=lora.max_lora_rank,
    )


def _publisher(config: ServerConfig, kv_topic: str) -> EventPublisher:
    if not config.events_enabled:
        return NullEventPublisher()
    publisher_config = PublisherConfig(
        host=config.zmq_host,
        port=config.kv_events_port,
        replay_port=config.kv_events_replay_port or None,
        topic=kv_topic,
        buffer_size=config.kv_events_buffer,
        data_parallel_rank=config.data_parallel_rank,
        curve=config.curve_keys,
    )
    if config.enable_fault_injection:
        return DroppingKVEventPublisher(publisher_config)
    return KVEventPublisher(publisher_config)
