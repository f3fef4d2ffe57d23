"""Policies, config validation, the SSE relay and the /metrics load parser (pure parts)."""

from __future__ import annotations

import asyncio
import json

import pytest

from cachekey.keys import HashNamespace, block_keys
from gateway.config import CostWeights, GatewayConfig
from gateway.fleet.prefix_load import hold, marks, sharing, unhold
from gateway.fleet.ranks import parse_engine_load
from gateway.fleet.replica import Replica
from gateway.names import ReplicaId
from gateway.routing.policies import POLICIES, RouteContext
from gateway.routing.policies.cache_aware import explain, fleet_rate
from gateway.serving.usage import SSERelay

NS = HashNamespace("demo", 16)


def _reps(n: int = 4) -> list[Replica]:
    return [Replica(ReplicaId(f"http://w{i}"), f"http://w{i}", healthy=True) for i in range(n)]


def _ctx(reps, tokens, matched=None, headers=None) -> RouteContext:
    keys = block_keys(tokens, NS)
    seed = keys[0] if keys else b"x"
    return RouteContext(reps, keys, len(tokens), 16, matched or {}, headers or {}, seed)


def _rank(name: str, ctx: RouteContext, config: GatewayConfig | None = None) -> list[Replica]:
    return POLICIES[name](config or GatewayConfig()).rank(ctx)


def test_cache_aware_prefers_the_longest_prefix_until_its_queue_outweighs_it():
    reps = _reps()
    tokens = list(range(320))  # 20 blocks
    ctx = _ctx(reps, tokens, {reps[2].id: 18, reps[1].id: 5})
    assert _rank("cache_aware", ctx)[0] is reps[2]
    # Queued prefill there: recomputing 15 blocks on reps[1] is cheaper than waiting for 300.
    reps[2].in_flight, reps[2].in_flight_prefill_tokens = 1, 16 * 300
    assert _rank("cache_aware", ctx)[0] is reps[1]
    # A short queue is not worth a recompute.
    reps[2].in_flight_prefill_tokens = 16 * 10
    assert _rank("cache_aware", ctx)[0] is reps[2]


def test_cache_aware_cost_is_seconds_at_the_candidates_median_rate():
    reps = _reps(3)
    reps[0].prefill_rate.seconds_per_token = 4e-4  # serves hits: its rate reads high
    reps[1].prefill_rate.seconds_per_token = 1e-4
    reps[2].prefill_rate.seconds_per_token = 2e-4
    policy = POLICIES["cache_aware"](GatewayConfig())
    ctx = _ctx(reps, list(range(320)), {reps[0].id: 10})
    # Every replica is costed at the median, 2e-4 s per token: the 160 uncached tokens on the
    # replica holding the prefix beat 320 on one whose own rate reads 4x lower.
    assert policy.rank(ctx)[0] is reps[0]
    assert fleet_rate(reps) == 2e-4
    cost = policy.cost(ctx, reps[0], 0.0, fleet_rate(reps))
    assert cost.prefill == pytest.approx(160 * 2e-4) and cost.queue == 0.0
    assert cost.total == pytest.approx(cost.queue + cost.prefill + cost.interference + cost.spread)
    assert fleet_rate(_reps(2)) == 1.0  # none measured: costs in tokens


def test_cache_aware_explains_each_decision_at_debug_level(caplog):
    reps = _reps(2)
    for r in reps:
        r.prefill_rate.seconds_per_token = 1e-3
    reps[1].in_flight, reps[1].in_flight_prefill_tokens = 1, 100
    ctx = _ctx(reps, list(range(64)), {reps[0].id: 2})
    policy = POLICIES["cache_aware"](GatewayConfig())
    text = explain(policy, ctx)
    # Cheapest first, in milliseconds: 32 uncached tokens (+32 interference) against 100
    # queued, 64 uncached and 128 interference.
    first, second = text.split("; ")
    assert first.startswith("(ms) http://w0 total=64 queue=0 prefill=32 interference=32 ")
    assert second.startswith("http://w1 total=292 queue=100 prefill=64 interference=128 ")
    assert "in_flight=1" in second
    with caplog.at_level("DEBUG", logger="gateway.routing.policies.cache_aware"):
        policy.rank(ctx)
    assert text in caplog.text
    for r in reps:  # no rate measured yet: the same decision, in tokens
        r.prefill_rate.seconds_per_token = None
    assert explain(policy, ctx).startswith("(tokens) http://w0 total=64 queue=0 prefill=32 ")


def test_cache_aware_keeps_cold_prefills_off_busy_replicas():
    """A cold prompt delays every request on its replica: it goes where fewer are decoding,
    counted by the gateway or (for other gateways' traffic) by the worker."""
    reps = _reps(2)
    ctx = _ctx(reps, list(range(320)))
    reps[0].running = 6
    reps[0].count_foreign()  # as a poll does: six requests this gateway did not send
    assert _rank("cache_aware", ctx)[0] is reps[1]
    reps[0].running, reps[1].in_flight = 0, 6
    reps[0].count_foreign()
    assert _rank("cache_aware", ctx)[0] is reps[0]


def test_cache_aware_busy_holders_lose_a_hot_prefix_to_an_idle_replica():
    """A holder is charged for its requests in flight that share the request's prefix beyond
    2, each at --busy-weight (0.5 by default) x the tokens it holds of the request: the holder
    wins while it is not much busier with the prefix than an idle replica that would recompute
    it, then the idle one takes it. Requests of other prefixes there cost no busy term."""
    reps = _reps(2)
    tokens = list(range(320))
    ctx = _ctx(reps, tokens, {reps[0].id: 19})
    same = marks(ctx.keys)
    policy = POLICIES["cache_aware"](GatewayConfig())
    for n in range(1, 9):
        reps[0].in_flight, reps[0].in_flight_prefixes = n, {}
        for _ in range(n):
            hold(reps[0].in_flight_prefixes, same)
        if policy.rank(ctx)[0] is reps[1]:
            break
    # Idle, the other costs its recompute and the next request's wait behind it (2 x 320
    # tokens); the holder its 16 uncached tokens (prefill, and interference with the n there
    # and the next) and 0.5 x 304 held tokens per request sharing it past 2:
    # 32 + 16 n + 152 (n - 2), dearer at 6.
    assert n == 6
    assert "busy=608 evict=0 sharing=6 " in explain(policy, ctx)
    # The same load from other tenants' prefixes: no busy term, the holder keeps its hit.
    other = marks(_ctx(reps, [t + 5000 for t in tokens]).keys)
    reps[0].in_flight_prefixes = {}
    for _ in range(n):
        hold(reps[0].in_flight_prefixes, other)
    assert policy.rank(ctx)[0] is reps[0]
    assert "busy=0 evict=0 sharing=0 " in explain(policy, ctx)
    # --busy-weight 0: the holder keeps it however busy with the prefix.
    reps[0].in_flight_prefixes = {}
    for _ in range(8):
        hold(reps[0].in_flight_prefixes, same)
    lazy = POLICIES["cache_aware"](GatewayConfig(weights=CostWeights(busy=0.0)))
    assert lazy.rank(ctx)[0] is reps[0]


def test_prefix_marks_count_requests_sharing_half_the_held_prefix():
    """`sharing` counts the requests in flight whose keys agree with the request's at the
    largest power of two of blocks the replica holds; `unhold` gives each mark back."""
    a = block_keys(list(range(320)), NS)  # 20 blocks
    b = block_keys(list(range(256)) + [9000 + t for t in range(64)], NS)  # shares 16 blocks
    counts: dict = {}
    hold(counts, marks(a))
    hold(counts, marks(b))
    assert [sharing(counts, a, m) for m in (0, 1, 15, 16, 19, 20)] == [0, 2, 2, 2, 2, 2]
    c = block_keys(list(range(128)) + [7000 + t for t in range(192)], NS)  # shares 8 blocks
    assert sharing(counts, c, 8) == 2 and sharing(counts, c, 16) == 0
    unhold(counts, marks(b))
    unhold(counts, marks(a))
    assert counts == {}


def test_ties_are_reproducible_per_request_and_spread_across_requests():
    reps = _reps()
    firsts = set()
    for g in range(40):
        tokens = [g * 1000 + t for t in range(64)]
        a = _rank("cache_aware", _ctx(reps, tokens))[0]
        b = _rank("cache_aware", _ctx(reps, tokens))[0]  # a second gateway, same inputs
        assert a is b
        firsts.add(a.id)
    assert len(firsts) == 4


def test_softmax_temperature_samples_near_ties():
    reps = _reps(2)
    for r in reps:
        r.prefill_rate.seconds_per_token = 1e-4
    cfg = GatewayConfig(softmax_temperature=0.005)  # seconds: about the costs' difference
    policy = POLICIES["cache_aware"](cfg)
    ctx = _ctx(reps, list(range(64)), {reps[0].id: 1})
    picks = {policy.rank(ctx)[0].id for _ in range(200)}
    assert picks == {reps[0].id, reps[1].id}


def test_round_robin_rotates_and_session_sticks_with_fallback():
    reps = _reps(3)
    policy = POLICIES["round_robin"](GatewayConfig())
    ctx = _ctx(reps, list(range(40)))
    assert [policy.rank(ctx)[0].id for _ in range(3)] == [r.id for r in reps]
    hdr = {"x-session-id": "alice"}
    home = _rank("session", _ctx(reps, list(range(40)), headers=hdr))
    assert home[0] is _rank("session", _ctx(reps, list(range(99)), headers=hdr))[0]
    # Its replica is gone: the session moves to the next in its own order, not a random one.
    others = [r for r in reps if r is not home[0]]
    assert _rank("session", _ctx(others, list(range(40)), headers=hdr))[0] is home[1]


def test_least_loaded_and_random_rank_everyone():
    reps = _reps()
    reps[0].in_flight, reps[1].waiting, reps[3].in_flight = 3, 1, 2
    ranked = _rank("least_loaded", _ctx(reps, list(range(40))))
    assert [r.id for r in ranked] == [reps[2].id, reps[1].id, reps[3].id, reps[0].id]
    assert sorted(r.id for r in _rank("random", _ctx(reps, list(range(40))))) == sorted(
        r.id for r in reps
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": "fastest"},
        {"workers": ("10.0.0.1:8000",)},
        {"port": 0},
        {"index_max_blocks": 0},
        {"retries": -1},
        {"softmax_temperature": -1.0},
        {"connect_timeout": 0},
        {"discovery": "k8s"},
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        GatewayConfig(**kwargs)


def test_cost_weights_reject_negative():
    with pytest.raises(ValueError):
        CostWeights(recent=-1)


def test_sse_relay_strips_unrequested_usage_across_chunk_boundaries():
    chunk = {"choices": [{"delta": {"content": "hi"}}], "usage": None}
    usage = {
        "choices": [],
        "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}},
    }
    stream = (
        b"data: " + json.dumps(chunk).encode() + b"\n\n"
        b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"
    )
    for keep_usage in (False, True):
        relay = SSERelay(strip_usage=not keep_usage)
        out = b"".join(relay.feed(stream[i : i + 7]) for i in range(0, len(stream), 7))
        out += relay.flush()
        assert relay.usage["prompt_tokens_details"]["cached_tokens"] == 4
        assert relay.saw_done and out.endswith(b"data: [DONE]\n\n")
        assert (b'"prompt_tokens": 5' in out) == keep_usage
        assert b'"content": "hi"' in out


def test_parse_load_reads_vllm_gauges():
    text = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{model_name="demo"} 3.0\n'
        'vllm:num_requests_running{model_name="demo"} 2.0\n'
        'vllm:kv_cache_usage_perc{model_name="demo"} 0.25\n'
        "vllm:prefix_cache_hits_total 7.0\n"
    )
    assert parse_engine_load(text)[None] == {"waiting": 3.0, "running": 2.0, "kv_usage": 0.25}


def test_circuit_breaker_ejects_after_repeated_failures():
    from gateway.fleet.breaker import CircuitBreaker
    from gateway.fleet.replica_set import ReplicaSet
    from gateway.index.block_index import BlockIndex
    from gateway.metrics import GatewayMetrics

    cfg = GatewayConfig(eject_after_failures=3, eject_seconds=30.0)
    metrics = GatewayMetrics()
    replicas = ReplicaSet(cfg, BlockIndex(), metrics, http=None)
    breaker = CircuitBreaker(cfg, metrics)
    try:
        a, b = _reps(2)
        replicas.replicas = {a.id: a, b.id: b}
        breaker.failure(a, "HTTP 500")
        breaker.failure(a, "HTTP 500")
        breaker.success(a)  # a success resets the streak
        breaker.failure(a, "HTTP 500")
        assert {r.id for r in replicas.available()} == {a.id, b.id}
        breaker.failure(a, "HTTP 500")
        breaker.failure(a, "connect failed")
        assert [r.id for r in replicas.available()] == [b.id]
        # A 503 names the ejected replica, why, and the healthy one.
        described = replicas.describe()
        assert f"{a.name} (ejected after 3 failures in a row (last: connect failed))" in described
        assert f"{b.name} (healthy)" in described
        a.healthy = True  # even a good probe does not end the ejection early
        assert [r.id for r in replicas.available()] == [b.id]
        a.circuit.close()
        assert {r.id for r in replicas.available()} == {a.id, b.id}
    finally:
        asyncio.run(replicas.close())


def test_prefill_rate_from_the_workers_vllm_histogram_sums():
    from gateway.fleet.prefill_rate import MIN_TOKENS, PrefillRate, parse_prefill_sums

    def page(seconds: float, tokens: float) -> str:
        return (
            "# TYPE vllm:request_prefill_time_seconds histogram\n"
            f'vllm:request_prefill_time_seconds_sum{{model_name="demo"}} {seconds}\n'
            'vllm:request_prefill_time_seconds_count{model_name="demo"} 3.0\n'
            f'vllm:request_prefill_kv_computed_tokens_sum{{model_name="demo"}} {tokens}\n'
        )

    assert parse_prefill_sums("vllm:num_requests_waiting 1.0\n") is None  # not exported
    rate = PrefillRate()
    rate.observe(parse_prefill_sums(page(1.0, 5000.0)))  # the baseline: no rate yet
    assert rate.seconds_per_token is None
    rate.observe(parse_prefill_sums(page(1.1, 5000.0 + MIN_TOKENS / 2)))  # too little: pooled
    assert rate.seconds_per_token is None
    rate.observe(parse_prefill_sums(page(1.4, 5000.0 + 2 * MIN_TOKENS)))
    assert rate.seconds_per_token == pytest.approx(0.4 / (2 * MIN_TOKENS))
    first = rate.seconds_per_token
    rate.observe(parse_prefill_sums(page(1.4 + 0.8, 5000.0 + 4 * MIN_TOKENS)))  # twice as slow
    assert first < rate.seconds_per_token < 2 * first  # smoothed towards it
    rate.observe(parse_prefill_sums(page(0.1, 100.0)))  # a restarted worker: a new baseline
    assert rate.seconds_per_token is not None
