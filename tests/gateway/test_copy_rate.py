"""The host-tier copy rate read from a worker's metrics, as vLLM's offloading connector and
kvgate's worker name them, and its prior."""

from __future__ import annotations

from gateway.fleet.copy_rate import PRIOR_RATIO, copy_seconds_per_token, parse_copy_sums
from gateway.fleet.prefill_rate import PrefillRate

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
