"""Plain vLLM workers: no /kvgate/info, so the gateway builds the same facts from what vLLM has.

The model and its context length come from /v1/models (`max_model_len`), the block size from
`vllm:cache_config_info`, the data-parallel ranks from the `engine` labels of /metrics, and the
KV-event endpoints from the worker's own entry (`--workers URL;kv-events=...`, or the named
ports of its EndpointSlice) or else the gateway's `--vllm-kv-events-*` flags (the worker's
`--kv-events-config`), each port offset by the rank as vLLM does (gateway/ranks.py). The index
still uses the gateway's own keys (recomputed from the events' token ids and extra keys), so
vLLM's hash algorithm and seed do not matter; the render assets must come from --model-dir.
There is no snapshot and no instance id: a restart shows as the seq going back, which resyncs
from the replay buffer.
"""

from __future__ import annotations

import re

import httpx

from cachekey.documents import KVEventsEndpoint, WorkerInfo
from cachekey.keys import DEFAULT_HASH_SEED
from gateway.config import GatewayConfig
from gateway.endpoints import WorkerEndpoint
from gateway.ranks import metrics_ranks, vllm_ranks

_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', re.MULTILINE)
INSTANCE = "vllm"


def parse_block_size(metrics_text: str) -> int | None:
    m = _BLOCK_SIZE.search(metrics_text)
    return int(m.group(1)) if m else None


async def vllm_info(
    http: httpx.AsyncClient,
    url: str,
    metrics_text: str,
    config: GatewayConfig,
    endpoint: WorkerEndpoint | None = None,
) -> WorkerInfo | None:
    """The WorkerInfo of a plain vLLM worker, or None if it is not one."""
    try:
        resp = await http.get(f"{url}/v1/models", timeout=config.connect_timeout)
        card = resp.json()["data"][0]
        model = card["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(model, str):
        return None
    model_len = card.get("max_model_len")
    ranks = vllm_ranks(
        metrics_ranks(metrics_text),
        endpoint or WorkerEndpoint(url),
        port=config.vllm_kv_events_port,
        replay_port=config.vllm_kv_events_replay_port,
        topic=config.vllm_kv_events_topic,
        model=model,
        connect=config.kv_events_bind is not None,
    )
    return WorkerInfo(
        model=model,
        block_size=parse_block_size(metrics_text) or 16,
        hash_seed=DEFAULT_HASH_SEED,  # the index re-keys vLLM's blocks: any shared seed works
        instance_id=INSTANCE,
        has_snapshot=False,
        engine="vllm",
        max_model_len=model_len if type(model_len) is int and model_len > 0 else None,
        data_parallel_rank=ranks[0].rank if len(ranks) == 1 else None,
        kv_events=ranks[0].kv_events if len(ranks) == 1 else KVEventsEndpoint(enabled=False),
        data_parallel_ranks=ranks,
    )
