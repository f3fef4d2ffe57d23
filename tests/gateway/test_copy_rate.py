"""The host-tier copy rate read from a worker's metrics, as vLLM's offloading connector and
kvgate's worker name them, and its prior; and learned end to end from a real sim worker."""

from __future__ import annotations

from pathlib import Path

import httpx

from gateway.fleet.copy_rate import PRIOR_RATIO, copy_seconds_per_token, parse_copy_sums
from gateway.fleet.prefill_rate import MIN_TOKENS, PrefillRate
from harness.cluster import Cluster, ClusterSpec
from harness.waits import wait_until
from tests.support.chat import chat
from tests.support.waits import wait_synced

COPY_GAUGE = "kvgate_replica_copy_seconds_per_token"

VLLM = """# TYPE vllm:kv_offload_load_time_total counter
vllm:kv_offload_load_time_total{engine="0",model_name="m"} 0.25
vllm:kv_offload_store_time_total{engine="0",model_name="m"} 9.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 4096.0
"""
OLDER = """vllm:kv_offload_total_time_total{transfer_type="CPU_to_GPU"} 0.5
vllm:kv_offload_total_time_total{transfer_type="GPU_to_CPU"} 7.0
vllm:external_prefix_cache_hits_total{engine="0"} 2048.0
vllm:external_prefix_cache_hits_total{engine="1"} 2048.0
"""


def test_both_metric_forms_and_their_absence():
    assert parse_copy_sums(VLLM) == (0.25, 4096.0)
    assert parse_copy_sums(OLDER) == (0.5, 4096.0)  # the stores' time is not a load's
    # vLLM 0.32 exports both families from the same counts: the newer alone, not their sum.
    both = VLLM + 'vllm:kv_offload_total_time_total{transfer_type="CPU_to_GPU"} 0.25\n'
    assert parse_copy_sums(both) == (0.25, 4096.0)
    assert parse_copy_sums("vllm:external_prefix_cache_hits_total 10\n") is None  # no time
    assert parse_copy_sums("") is None


def test_measured_like_the_prefill_rate_and_the_prior_until_then():
    rate = PrefillRate()
    rate.observe(parse_copy_sums(VLLM))
    assert rate.seconds_per_token is None
    assert copy_seconds_per_token(rate.seconds_per_token, 2e-5) == PRIOR_RATIO * 2e-5
    grown = VLLM.replace(" 0.25", " 0.45").replace(" 4096.0", " 8192.0")
    rate.observe(parse_copy_sums(grown))
    assert abs(rate.seconds_per_token - 0.2 / 4096) < 1e-12
    assert copy_seconds_per_token(rate.seconds_per_token, 2e-5) == rate.seconds_per_token
    assert 0.05 < PRIOR_RATIO < 0.1  # the H200 figures: 4.9 ms of copy against 57.4 of prefill


def _sum(text: str, name: str) -> float:
    """A metric's samples summed over their labels (prometheus text)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _copy_rate_gauge(gateway_url: str) -> float | None:
    text = httpx.get(f"{gateway_url}/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith(COPY_GAUGE + "{")]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else None


def test_a_kvgate_worker_exports_its_load_time_and_the_gateway_learns_it(tmp_path: Path):
    """A sim worker with the H200 preset and a host tier charges each host hit's copy at the
    preset's rate and exports that time as vLLM does (`vllm:kv_offload_load_time`); the gateway
    measures the replica's copy rate from it: off the prior, equal to the worker's own seconds
    over its host-tier tokens."""
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=40,
        worker_args=("--sim-preset", "h200-llama-1b", "--kv-offload-blocks", "400"),
        gateway_args=("--poll-interval", "0.2"),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        wait_synced(c.gateway_url, 1)
        worker = c.worker_urls[0]
        assert _copy_rate_gauge(c.gateway_url) is None  # no copy yet: the prior prices one
        for k in range(4):  # ~400 host-tier tokens each, past MIN_TOKENS in all
            system = {"role": "system", "content": f"Tenant {k} audits shipping invoices. " * 25}
            assert chat(worker, [system, {"role": "user", "content": "hi"}]).status_code == 200
            for i in range(6):  # fill the GPU's 40 blocks twice over: the system prompt leaves
                words = f"Unrelated ledger {k} {i} entry lines follow. " * 12
                assert chat(worker, [{"role": "user", "content": words}]).status_code == 200
            r = chat(c.gateway_url, [system, {"role": "user", "content": "and now?"}])
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cpu_cached_tokens"] >= 16 * 16
        text = httpx.get(f"{worker}/metrics").text
        seconds = _sum(text, "vllm:kv_offload_load_time_total")
        tokens = _sum(text, "vllm:external_prefix_cache_hits_total")
        assert tokens >= MIN_TOKENS and seconds > 0
        # The preset's copy: 32 KiB of K/V per token at the H200's 55 GB/s.
        assert abs(seconds / tokens - 32768 / 55e9) < 0.05 * 32768 / 55e9
        wait_until(lambda: _copy_rate_gauge(c.gateway_url) is not None, 10, "a measured copy rate")
        learned = _copy_rate_gauge(c.gateway_url)
        assert learned is not None and abs(learned - seconds / tokens) < 1e-3 * learned
