"""Tier-aware routing end to end: sim workers with a host KV tier (`--kv-offload-blocks`) publish
`medium: "CPU"` events over real ZMQ, and a real gateway routes by them: a replica holding a
prefix only in its host tier beats a cold replica (a copy is cheaper than a prefill), and loses
to one holding it on its GPU (a copy is dearer than nothing), loads being equal; the predicted
cached tokens, per tier, are what the worker reports."""

from __future__ import annotations

import json

import httpx
import pytest

from cachekey.documents import WorkerInfo, decode_document
from gateway.fleet.ranks import rank_slots
from harness.cluster import Cluster, ClusterSpec
from harness.waits import wait_index_converged, wait_until
from tests.support.chat import chat
from tests.support.waits import wait_synced

SYSTEM = {"role": "system", "content": "You audit invoices for a shipping company. " * 25}
GPU_BLOCKS = 40  # 640 tokens: the six flushing prompts below evict the system prompt's blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=GPU_BLOCKS,
        worker_args=("--kv-offload-blocks", "400"),
        gateway_args=("--poll-interval", "0.2"),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        wait_synced(c.gateway_url, 2)
        yield c


def _flush_gpu(worker_url: str, tag: str) -> None:
    """Evict everything from a worker's GPU cache into its host tier: prompts sent to it
    directly (the gateway routes none of them) that fill its cache twice over."""
    for i in range(6):
        words = f"Unrelated ledger {tag} {i} entry lines follow. " * 12
        r = chat(worker_url, [{"role": "user", "content": words}])
        assert r.status_code == 200, r.text


def _host_blocks(gateway_url: str, worker_url: str) -> int:
    return httpx.get(f"{gateway_url}/kvgate/index").json()["replicas"][worker_url]["host_blocks"]


def _ask(cluster: Cluster, question: str, gateway: str | None = None) -> tuple[str, int, int]:
    """(the worker that served it, predicted GPU and CPU tokens), each tier's prediction
    checked against what the worker reports for it."""
    r = chat(gateway or cluster.gateway_url, [SYSTEM, {"role": "user", "content": question}])
    assert r.status_code == 200, r.text
    gpu, cpu = _predicted(r.headers)
    assert gpu + cpu == int(r.headers["x-kvgate-predicted-cached-tokens"])
    assert (gpu, cpu) == _reported(r.json()["usage"])
    return cluster.served_by(r), gpu, cpu


def _predicted(headers: httpx.Headers) -> tuple[int, int]:
    gpu = int(headers["x-kvgate-predicted-gpu-cached-tokens"])
    return gpu, int(headers["x-kvgate-predicted-cpu-cached-tokens"])


def _reported(usage: dict) -> tuple[int, int]:
    """The worker's (GPU, host tier) cached tokens: its total and kvgate's host part."""
    details = usage["prompt_tokens_details"]
    return details["cached_tokens"] - details["cpu_cached_tokens"], details["cpu_cached_tokens"]


def _settle(cluster: Cluster, host_holder: str) -> None:
    gw = cluster.gateway_url
    wait_until(lambda: _host_blocks(gw, host_holder) > 0, 15, "the host tier's events")
    wait_index_converged(gw, cluster.worker_urls)


def test_a_worker_says_its_host_tiers_size(cluster):
    """What cache_aware's eviction price needs (a full GPU cache evicts into the host tier, and
    loses blocks only when that is full too): /kvgate/info carries both sizes to the slot."""
    for url in cluster.worker_urls:
        info = decode_document(httpx.get(f"{url}/kvgate/info").content, WorkerInfo)
        assert (info.num_blocks, info.host_num_blocks) == (GPU_BLOCKS, 400)
        (slot,) = rank_slots(info)
        assert (slot.num_blocks, slot.host_num_blocks) == (GPU_BLOCKS, 400)


def test_host_tier_holder_beats_cold_and_loses_to_gpu_holder(cluster):
    gw = cluster.gateway_url
    first, _, _ = _ask(cluster, "What is an invoice?")
    other = next(u for u in cluster.worker_urls if u != first)
    _flush_gpu(first, "a")
    _settle(cluster, first)
    # `first` holds the system prompt in its host tier only; `other` holds nothing of it.
    served, gpu, cpu = _ask(cluster, "What is a credit note?")
    assert served == first
    # The system prompt's blocks, from the host tier: the worker copied back exactly these.
    assert gpu == 0 and cpu >= 16 * 16
    # Now `other` computes the prompt (sent to it directly) and `first` evicts it again.
    assert chat(other, [SYSTEM, {"role": "user", "content": "hello"}]).status_code == 200
    _flush_gpu(first, "b")
    _settle(cluster, first)
    served, gpu, cpu = _ask(cluster, "What is a bill of lading?")
    assert served == other
    assert cpu == 0 and gpu >= 16 * 16
    metrics = httpx.get(f"{gw}/metrics").text
    assert "kvgate_predicted_cpu_cached_tokens_total" in metrics
    # The sim without a preset copies for free and times nothing: no load time to learn a copy
    # rate from, so the prior prices these replicas' host hits
    # (tests/gateway/test_copy_rate.py has one).
    assert "vllm:kv_offload_load_time" not in httpx.get(f"{first}/metrics").text
    assert "kvgate_replica_copy_seconds_per_token{" not in metrics


def test_ignoring_the_host_tier_sees_only_the_gpu(cluster):
    """A second gateway on the same fleet with --ignore-host-tier: a prefix held only in a host
    tier is no hit to it (predicted 0), though the worker still serves it from there."""
    blind = cluster.make_gateway(1)
    blind.args.append("--ignore-host-tier")
    blind.start()
    try:
        blind.wait_healthy(60)
        wait_synced(blind.url, 2)
        holder, _, _ = _ask(cluster, "Who signs an invoice?")
        _flush_gpu(holder, "c")
        _settle(cluster, holder)
        wait_until(lambda: _host_blocks(blind.url, holder) > 0, 15, "the host tier's events")
        r = chat(blind.url, [SYSTEM, {"role": "user", "content": "Who pays it?"}])
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-predicted-cached-tokens"] == "0"
        assert r.headers["x-kvgate-predicted-cpu-cached-tokens"] == "0"
        if cluster.served_by(r) == holder:  # else it went to the cold one: no hit at all
            # The worker still copied the prefix back: the prediction the flag gives up.
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 16
    finally:
        blind.kill()


def test_a_gateway_started_later_learns_the_host_tier_from_the_snapshot(cluster):
    """A worker's host tier fills before a gateway exists; that gateway's only source for it is
    the worker's `/kv/snapshot` (it replays events after the snapshot's seq only), and it
    predicts the host-tier hit exactly."""
    audit = {"role": "system", "content": "You reconcile freight manifests against customs. " * 25}
    holder = cluster.worker_urls[0]
    assert chat(holder, [audit, {"role": "user", "content": "hi"}]).status_code == 200
    _flush_gpu(holder, "d")
    late = cluster.make_gateway(2)
    late.start()
    try:
        late.wait_healthy(60)
        wait_synced(late.url, 2)
        assert _host_blocks(late.url, holder) > 0
        r = chat(late.url, [audit, {"role": "user", "content": "What is a manifest?"}])
        assert r.status_code == 200, r.text
        assert cluster.served_by(r) == holder
        gpu, cpu = _predicted(r.headers)
        assert gpu == 0 and cpu >= 16 * 16
        assert (gpu, cpu) == _reported(r.json()["usage"])
        # Streamed: the same split, in the usage chunk (response headers leave too early).
        streamed = _stream_usage(late.url, [audit, {"role": "user", "content": "And a bill?"}])
        assert streamed[1] == _reported(streamed[2])
        assert streamed[1][0] >= 16 * 16  # now on the GPU again: copied back by the last one
    finally:
        late.kill()


def _stream_usage(gateway: str, messages: list[dict]) -> tuple[str, tuple[int, int], dict]:
    """A streamed chat through `gateway`: (its replica, its predicted (GPU, CPU) tokens, the
    usage of its last chunk)."""
    body = {
        "model": "demo",
        "messages": messages,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return r.headers["x-kvgate-replica"], _predicted(r.headers), chunks[-1]["usage"]
