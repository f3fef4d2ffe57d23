"""WorkerState: everything the worker's routes use, built once by `init_app_state`.

A worker serves one engine, or several (`--data-parallel-size`, as vLLM's data parallel: each
engine has its own KV cache, publisher and ports, and a request names one with
`X-data-parallel-rank`). One `WorkerState` per engine; routes reach them through
`request.app.state` (`worker_state` for what all engines share, `rank_state` for the engine a
request goes to, `all_ranks`); nothing here imports a router or the app module.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
from fastapi import Request
from starlette.datastructures import State

from cachekey.documents import (
    AssetFiles,
    FingerprintParts,
    KVEventsEndpoint,
    LoRAAdapters,
    RankInfo,
    WorkerInfo,
)
from kvgate_cli.drain import OpenStreams
from worker.engine.config import EngineConfig
from worker.engine.outputs import LoRAStats
from worker.engine.sim_presets import preset
from worker.server.config import ServerConfig
from worker.server.core_process import CoreHandle
from worker.server.engine_client import AsyncEngine
from worker.server.faults import FaultInjector
from worker.server.metrics import WorkerMetrics
from worker.server.serving import ServingContext, rank_index
from worker.server.serving_chat import ServingChat
from worker.server.serving_completion import ServingCompletion
from worker.server.serving_embedding import ServingEmbedding


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One engine of the worker; `info`, `metrics` and `assets` are the whole worker's."""

    config: ServerConfig
    info: WorkerInfo
    engine: AsyncEngine
    metrics: WorkerMetrics
    chat: ServingChat
    completion: ServingCompletion
    embedding: ServingEmbedding
    assets: AssetFiles
    max_num_seqs: int
    created: int  # the model card's `created`
    faults: FaultInjector | None  # only with --enable-fault-injection
    rank: int | None = None  # its data-parallel rank (None: not data parallel)


def worker_state(request: Request) -> WorkerState:
    """The first engine's state: what every engine of the worker shares."""
    return request.app.state.worker


def all_ranks(request: Request) -> list[WorkerState]:
    return request.app.state.ranks


def rank_state(request: Request) -> WorkerState:
    """The engine a request names with X-data-parallel-rank, else the least loaded one."""
    ranks = all_ranks(request)
    i = rank_index(request, len(ranks))
    if i is not None:
        return ranks[i]
    if len(ranks) == 1:
        return ranks[0]
    return min(ranks, key=lambda r: (s := r.engine.stats()).num_running + s.num_waiting)


def init_app_state(
    state: State, cores: Sequence[CoreHandle], config: ServerConfig, identity: tuple[str, str]
) -> WorkerState:
    """Build the worker's state around started engine cores (one per data-parallel rank) and
    store it on `state` (once). `identity`: the instance id and KV-event topic
    (launch.py's new_identity)."""
    if getattr(state, "worker", None) is not None:
        raise RuntimeError("the worker's app state is already initialized")
    ranks = config.engine_ranks()
    if len(cores) != len(ranks):
        raise ValueError(f"--data-parallel-size {len(ranks)} needs as many engines")
    instance_id, kv_topic = identity
    first = cores[0]
    model_name = first.config.served_model_name
    assert model_name is not None  # EngineConfig fills it in
    async_engines = [
        AsyncEngine(
            c,
            stall_timeout_s=config.engine_stall_timeout_s,
            host_seconds=sim_host_seconds(c.config),
            host_in_thread=c.config.sim_server_model == "thread",
        )
        for c in cores
    ]
    info = worker_info(cores, config, instance_id, kv_topic)
    metrics = WorkerMetrics(
        [(str(r or 0), ae.stats) for r, ae in zip(ranks, async_engines, strict=True)],
        model_name,
        block_size=info.block_size,
        num_gpu_blocks=first.ready.stats.num_blocks,
        enable_prefix_caching=first.config.enable_prefix_caching,
    )
    state.streams = streams = OpenStreams()  # every rank's, cut together by a drain
    states = [
        _rank_state(config, info, core, ae, metrics, streams, i, ranks[i])
        for i, (core, ae) in enumerate(zip(cores, async_engines, strict=True))
    ]
    state.worker, state.ranks = states[0], states
    return states[0]


def sim_host_seconds(config: EngineConfig) -> Callable[[int], float] | None:
    """A sim worker with `--sim-server-model apart` or `thread`: the seconds its API server
    spends on a request it passes on among `streams` in flight (the preset's per-request and
    per-stream server terms, times the time scale); None for every other worker."""
    if config.engine != "sim" or not config.sim_preset or config.sim_server_model == "step":
        return None
    cost, scale = preset(config.sim_preset, config.sim_server_scale), config.sim_time_scale
    return lambda streams: cost.host(streams) * scale


def _rank_state(
    config: ServerConfig,
    info: WorkerInfo,
    core: CoreHandle,
    engine: AsyncEngine,
    metrics: WorkerMetrics,
    streams: OpenStreams,
    i: int,
    rank: int | None,
) -> WorkerState:
    model_name = core.config.served_model_name
    assert model_name is not None
    faults = FaultInjector(engine, config.events_enabled) if config.enable_fault_injection else None
    ctx = ServingContext(
        engine,
        core.renderer,
        model_name,
        core.ready.max_model_len,
        metrics.engines[i],
        hidden_layers=core.ready.hidden_layers,
        streams=streams,
        faults=faults,
    )
    model_config = json.loads(core.assets.files.get("config.json", b"{}"))
    return WorkerState(
        config=config,
        info=info,
        engine=engine,
        metrics=metrics,
        chat=ServingChat(ctx),
        completion=ServingCompletion(ctx),
        embedding=ServingEmbedding(ctx, model_config),
        assets=AssetFiles(dict(core.assets.files)),
        max_num_seqs=core.config.max_num_seqs,
        created=int(time.time()),
        faults=faults,
        rank=rank,
    )


def worker_info(
    cores: Sequence[CoreHandle], config: ServerConfig, instance_id: str, kv_topic: str
) -> WorkerInfo:
    """What `/kvgate/info` says: how this worker keys blocks and where its events are."""
    engine = cores[0]
    ns = engine.namespace
    parts = FingerprintParts(
        **engine.assets.fingerprint_parts(),
        assets=engine.assets.fingerprint(),
        block_size=ns.block_size,
        hash_seed=ns.seed,
        namespace_model=ns.model,
    )
    ranks = config.engine_ranks()
    endpoints = [_endpoint(config, kv_topic, i) for i in range(len(ranks))]
    return WorkerInfo(
        model=ns.model,
        model_path=str(engine.config.model),
        block_size=ns.block_size,
        hash_seed=ns.seed,
        fingerprint=parts.digest(),
        fingerprint_parts=parts,
        instance_id=instance_id,
        data_parallel_rank=ranks[0],
        engine=engine.config.engine,
        max_model_len=engine.ready.max_model_len,
        num_blocks=engine.ready.stats.num_blocks,
        host_num_blocks=engine.ready.stats.host_num_blocks or None,
        defers_shared_prefill=engine.config.enable_prefix_caching,
        mm_match_rule=engine.config.mm_match_rule,
        kv_events=endpoints[0],
        data_parallel_ranks=(
            [
                RankInfo(
                    rank=r or 0,
                    kv_events=ep,
                    num_blocks=c.ready.stats.num_blocks,
                    host_num_blocks=c.ready.stats.host_num_blocks or None,
                )
                for r, ep, c in zip(ranks, endpoints, cores, strict=True)
            ]
            if len(ranks) > 1
            else []
        ),
    )


def current_info(ranks: Sequence[WorkerState]) -> WorkerInfo:
    """The worker's info with its LoRA adapters as each engine core last sent them:
    the first engine's at the top, and each rank's own (its resident slots) in its RankInfo."""
    info = ranks[0].info
    loras = [r.engine.stats().lora for r in ranks]
    if loras[0] is None:
        return info
    replace = msgspec.structs.replace
    per_rank = [
        replace(ri, lora=lora_adapters(lora) if lora is not None else None)
        for ri, lora in zip(info.data_parallel_ranks, loras, strict=False)
    ]
    return replace(info, lora=lora_adapters(loras[0]), data_parallel_ranks=per_rank)


def lora_adapters(lora: LoRAStats) -> LoRAAdapters:
    return LoRAAdapters(
        max_loras=lora.max_loras,
        adapters=[name for name, _ in lora.adapters],
        resident=list(lora.resident),
        max_lora_rank=lora.max_lora_rank,
    )


def _endpoint(config: ServerConfig, kv_topic: str, i: int) -> KVEventsEndpoint:
    """Engine i's events endpoint: the configured ports + i (vLLM offsets by the rank)."""
    events = config.events_enabled
    replay = config.kv_events_replay_port
    return KVEventsEndpoint(
        enabled=events,
        port=config.kv_events_port + i if events else None,
        replay_port=replay + i if events and replay else None,
        topic=kv_topic,
        curve=events and config.worker_token is not None,
    )
