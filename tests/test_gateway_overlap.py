"""Overlapping requests through a real gateway and real sim workers: the predicted cached tokens
equal the reported ones when siblings that share a prefix arrive while it is being computed,
and the gateway learns each worker's prefill rate from the worker's own metrics."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec, metric_total

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
