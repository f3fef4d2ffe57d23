"""Overlapping requests through a real gateway and real sim workers: the predicted cached tokens
equal the reported ones when siblings that share a prefix arrive while it is being computed,
and the gateway learns each worker's prefill rate from the worker's own metrics."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.prom import metric_total
from harness.waits import wait_index_converged

pytestmark = pytest.mark.slow

# Prefill takes time (1 ms per token, 64 tokens a step), so siblings overlap mid-prefill.
WORKER_ARGS = ("--sim-prefill-s-per-token", "0.001", "--max-num-batched-tokens", "64")


def _body(group: int, i: int) -> dict:
    return {
        "model": "demo",
        "messages": [
            {"role": "system", "content": f"You answer for group {group}. " * 40},
            {"role": "user", "content": f"question {i}: " + "why " * (i % 7)},
        ],
        "max_tokens": 4,
        "stream": i % 2 == 0,
        "stream_options": {"include_usage": True} if i % 2 == 0 else None,
    }


async def _send(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, int]:
    """(predicted, reported) cached tokens of one request, streamed or not."""
    body = {k: v for k, v in body.items() if v is not None}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
        if not body["stream"]:
            usage = (await r.aread()) and r.json()["usage"]
        else:
            usage = None
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage") or usage
    return predicted, usage["prompt_tokens_details"]["cached_tokens"]


async def _burst(url: str, group: int, n: int) -> list[tuple[int, int]]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(_send(client, url, _body(group, i)) for i in range(n)))


def test_siblings_in_flight_are_predicted_exactly(tmp_path):
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=512,
        worker_args=WORKER_ARGS,
        gateway_args=("--poll-interval", "0.2"),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        url = c.gateway_url
        results = []
        for group in range(3):  # a cold burst per group: its first request computes the prefix
            results += asyncio.run(_burst(url, group, 8))
        mismatched = [(p, r) for p, r in results if p != r]
        assert not mismatched, mismatched
        assert sum(r for _, r in results) > 0  # siblings did hit the prefix being computed

        # The gateway measured the workers' prefill rates from their vllm:request_prefill_* sums:
        # at least the sim's 1 ms per computed token (an interval also holds other prefills).
        def rate() -> float:
            return metric_total(url, "kvgate_replica_prefill_seconds_per_token")

        deadline = time.monotonic() + 10
        while rate() == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rate() >= 0.001


def _complete(url: str, ids: list[int], headers: dict | None = None) -> int:
    """Cached tokens of one token-id completion sent straight to `url`."""
    body = {"model": "demo", "prompt": ids, "max_tokens": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _last_key(worker: str, ids: list[int]) -> str:
    """The key, in hex, of the deepest cached block whose tokens end `ids`' full blocks."""
    blocks = httpx.get(f"{worker}/kv/snapshot", timeout=10).json()["blocks"]
    tail = ids[(len(ids) // 16 - 1) * 16 : (len(ids) // 16) * 16]
    return next(b["key"] for b in blocks if b["token_ids"] == tail)


def test_a_prefix_hint_keeps_its_chain_through_the_evictions_of_the_next_request(tmp_path):
    """32 blocks of 16: a (81 tokens) and b cache 5 blocks each, a first, so a's are the oldest.
    c (410 tokens, 26 blocks) then takes the 20 never-used blocks and 6 from the LRU head: all of
    a's, or, when c names a's chain in x-kvgate-prefix, b's instead."""
    spec = ClusterSpec(workers=1, engine="sim", num_blocks=32, log_dir=tmp_path, gateways=0)
    a, b, c = list(range(10, 91)), list(range(100, 181)), list(range(200, 610))
    with Cluster(spec) as cl:
        w = cl.worker_urls[0]
        for hint in (False, True):
            assert httpx.post(f"{w}/reset_prefix_cache", timeout=10).status_code == 200
            assert _complete(w, a) == 0 and _complete(w, b) == 0
            headers = {"x-kvgate-prefix": _last_key(w, a)} if hint else {}
            _complete(w, c, headers)
            assert _complete(w, a) == (80 if hint else 0)
        assert metric_total(w, "kvgate_worker_prefix_hint_blocks_total") == 5


def test_the_gateway_names_the_predicted_hit_to_its_worker(tmp_path):
    """A repeated prompt: the gateway predicts a hit and sends the key of its last block, which
    the worker finds as a whole cached chain (its refreshed blocks are counted)."""
    spec = ClusterSpec(workers=1, engine="sim", num_blocks=256, log_dir=tmp_path)
    with Cluster(spec) as cl:
        body = {"model": "demo", "prompt": list(range(10, 91)), "max_tokens": 1}
        predicted = []
        for _ in range(2):
            r = httpx.post(f"{cl.gateway_url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            predicted.append(int(r.headers["x-kvgate-predicted-cached-tokens"]))
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted[-1]
            wait_index_converged(cl.gateway_url, cl.worker_urls)
        assert predicted == [0, 80]
        assert metric_total(cl.worker_urls[0], "kvgate_worker_prefix_hint_blocks_total") == 5
