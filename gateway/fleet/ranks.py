"""Data-parallel ranks behind one worker URL: one replica each.

vLLM with `--data-parallel-size N` serves N engines behind one API server; so does a kvgate
worker with `--data-parallel-size N`. Each rank has its own KV cache, so the gateway indexes,
loads and routes each one apart: a request names its rank with `X-data-parallel-rank`, whose
value is the rank's index among the ranks that server serves (vLLM checks it against that
count, so a server running only rank 3 takes index 0: the header is left out where one rank is
served). Each rank publishes on the events and replay ports plus its global rank (vLLM's
`offset_endpoint_port`) and stamps that rank into its batches.

A kvgate worker lists its ranks in `/kvgate/info` (`data_parallel_ranks`); a vLLM worker's are
the `engine` labels of its `/metrics`. Both become `RankSlot`s here.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from cachekey.documents import KVEventsEndpoint, LoRAAdapters, RankInfo, WorkerInfo
from gateway.discovery.endpoints import WorkerEndpoint, format_topic

_LOAD_GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
_ENGINE = re.compile(r'[{,]engine="(\d+)"')
_RUNNING = re.compile(r'^vllm:num_requests_running\{[^}]*engine="(\d+)"', re.MULTILINE)


@dataclass(frozen=True, slots=True)
class RankSlot:
    """One rank behind a worker URL, as a replica needs it."""

    rank: int | None  # the global rank its batches name (None: not data parallel)
    header: int | None  # the X-data-parallel-rank value (None: no header)
    engine: str | None  # its `engine` label in /metrics (None: the sum over every label)
    kv_events: KVEventsEndpoint
    num_blocks: int | None
    snapshot_path: str | None  # None: no snapshot (plain vLLM)
    host_num_blocks: int | None = None  # its host KV tier's size (None: none, or not said)


def rank_slots(info: WorkerInfo) -> list[RankSlot]:
    """The ranks a worker serves, in header order."""
    snapshot = "/kv/snapshot" if info.has_snapshot else None
    ranks = info.data_parallel_ranks
    if not ranks:
        rank = info.data_parallel_rank
        return [
            RankSlot(
                rank, None, None, info.kv_events, info.num_blocks, snapshot, info.host_num_blocks
            )
        ]
    many = len(ranks) > 1
    return [
        RankSlot(
            r.rank,
            i if many else None,
            str(r.rank),
            r.kv_events,
            r.num_blocks,
            f"{snapshot}?rank={r.rank}" if snapshot else None,
            r.host_num_blocks,
        )
        for i, r in enumerate(ranks)
    ]


def metrics_ranks(metrics_text: str) -> list[int]:
    """The global ranks of a vLLM server's engines: the `engine` labels of its gauges."""
    return sorted({int(m) for m in _RUNNING.findall(metrics_text)})


def parse_engine_load(text: str) -> dict[str | None, dict[str, float]]:
    """The load gauges of a vLLM-style /metrics page: per `engine` label, and summed (None)."""
    out: dict[str | None, dict[str, float]] = {None: dict.fromkeys(_LOAD_GAUGES.values(), 0.0)}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        attr = _LOAD_GAUGES.get(name)
        if attr is None:
            continue
        with contextlib.suppress(ValueError):
            value = float(line.rsplit(" ", 1)[1])
            out[None][attr] += value
            m = _ENGINE.search(line)
            if m:
                load = out.setdefault(m.group(1), dict.fromkeys(_LOAD_GAUGES.values(), 0.0))
                load[attr] += value
    return out


def vllm_ranks(
    ranks: list[int],
    endpoint: WorkerEndpoint,
    *,
    port: int | None,
    replay_port: int | None,
    topic: str,
    model: str,
    connect: bool,
) -> list[RankInfo]:
    """What a vLLM server's --kv-events-config makes of each rank: ports offset by the rank.

    `connect`: its publishers connect to the gateway's central SUB, so there is no PUB to
    connect to (port None); the replay ROUTER is still the worker's, bound as vLLM binds it.
    """
    port = endpoint.kv_events_port or port
    replay = endpoint.kv_replay_port or replay_port
    url_port = _url_port(endpoint.url)
    name = format_topic(endpoint.kv_topic or topic, endpoint.host, url_port, endpoint.pod, model)
    return [
        RankInfo(
            rank=r,
            kv_events=KVEventsEndpoint(
                enabled=connect or port is not None,
                port=None if connect or port is None else port + r,
                replay_port=None if replay is None else replay + r,
                topic=name,
            ),
        )
        for r in ranks or [0]
    ]


def _url_port(url: str) -> int | None:
    try:
        return urlsplit(url).port
    except ValueError:
        return None


def worker_layout(info: WorkerInfo | None) -> tuple | None:
    """What, besides the instance id, makes a worker a new one to the index: its block size
    and where each rank publishes (a vLLM worker restarted with other ranks keeps its id)."""
    if info is None:
        return None
    ranks = tuple((r.rank, r.kv_events) for r in info.data_parallel_ranks)  # not their LoRA
    return (info.block_size, info.kv_events, ranks)


def rank_loras(info: WorkerInfo) -> list[LoRAAdapters | None]:
    """Each rank's LoRA adapters, in header order: its own slots where it reports them."""
    if not info.data_parallel_ranks:
        return [info.lora]
    return [r.lora or info.lora for r in info.data_parallel_ranks]
