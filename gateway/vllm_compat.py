"""Plain vLLM workers: no /kvgate/info, so the gateway builds the same facts from what vLLM has.

The model comes from /v1/models, the block size from `vllm:cache_config_info`, the KV-event
endpoints from the gateway's `--vllm-kv-events-*` flags (the worker's `--kv-events-config`). The
index still uses the gateway's own keys (recomputed from the events' token ids and extra keys),
so vLLM's hash algorithm and seed do not matter; the render assets must come from --model-dir.
There is no snapshot and no instance id: a restart shows as the seq going back, which resyncs
from empty.
"""

from __future__ import annotations

import re

import httpx

from cachekey.documents import KVEventsEndpoint, WorkerInfo
from cachekey.keys import DEFAULT_HASH_SEED
from gateway.config import GatewayConfig

_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', re.MULTILINE)
INSTANCE = "vllm"


def parse_block_size(metrics_text: str) -> int | None:
    m = _BLOCK_SIZE.search(metrics_text)
    return int(m.group(1)) if m else None


async def vllm_info(
    http: httpx.AsyncClient, url: str, metrics_text: str, config: GatewayConfig
) -> WorkerInfo | None:
    """The WorkerInfo of a plain vLLM worker, or None if it is not one."""
    try:
        resp = await http.get(f"{url}/v1/models", timeout=config.connect_timeout)
        model = resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(model, str):
        return None
    return WorkerInfo(
        model=model,
        block_size=parse_block_size(metrics_text) or 16,
        hash_seed=DEFAULT_HASH_SEED,  # the index re-keys vLLM's blocks: any shared seed works
        instance_id=INSTANCE,
        has_snapshot=False,
        kv_events=KVEventsEndpoint(
            enabled=config.vllm_kv_events_port is not None,
            port=config.vllm_kv_events_port,
            replay_port=config.vllm_kv_events_replay_port,
            topic=config.vllm_kv_events_topic,
        ),
    )
