"""What fronting hundreds of workers takes: polls and event tail checks within their rate however
many workers (gateway/pace.py, measured on real polls of a simulated fleet), a ZMQ context
that holds a SUB and a replay DEALER for each of them, and a match that looks only at the
replicas holding a request's prefix."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
import zmq

from cachekey.events import BlockStored
from cachekey.keys import HashNamespace, block_keys
from gateway.config import GatewayConfig
from gateway.discovery.endpoints import WorkerEndpoint
from gateway.events.followers import event_context
from gateway.fleet.replica import Replica
from gateway.fleet.replica_set import ReplicaSet
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.names import ReplicaId
from gateway.pace import Pace
from gateway.routing.policies import RouteContext
from gateway.routing.policies.base import tie_order
from gateway.routing.policies.cache_aware import TOP, CacheAwarePolicy
from harness.fleet.engine import Timing
from harness.fleet.fleet import Fleet, FleetConfig


def test_period_stretches_past_the_rate_and_delays_spread():
    pace = Pace(0.5, max_per_second=100)
    for _ in range(40):
        pace.join()
    assert pace.period() == 0.5  # 40 members every 0.5 s: 80/s, within the rate
    for _ in range(460):
        pace.join()
    assert pace.period() == pytest.approx(5.0)  # 500 members: 100/s at most
    assert all(0 <= pace.first_delay() <= 5.0 for _ in range(100))
    assert all(4.5 <= pace.delay() <= 5.5 for _ in range(100))
    pace.leave()
    assert pace.members == 499
    assert Pace(0.5).period() == 0.5  # no bound
    with pytest.raises(ValueError):
        Pace(0.0)


def test_polls_of_a_fleet_stay_within_max_polls_per_second():
    async def run() -> int:
        config = FleetConfig(replicas=8, num_blocks=20, timing=Timing(0.0, 0.0, 0.0))
        async with Fleet(config) as fleet, httpx.AsyncClient() as http:
            polls = [0]
            for rep in fleet.replicas:  # count the polls each replica answers
                answer = rep._routes[("GET", "/health")]

                def counted(ex, answer=answer):
                    polls[0] += 1
                    answer(ex)

                rep._routes[("GET", "/health")] = counted
            gw = GatewayConfig(poll_interval=0.05, max_polls_per_second=20, kv_events=False)
            replicas = ReplicaSet(gw, BlockIndex(), GatewayMetrics(), http)
            try:
                await replicas.set_workers(frozenset(WorkerEndpoint(u) for u in fleet.urls))
                await asyncio.sleep(2.0)
                assert all(r.healthy for r in replicas.replicas.values())
            finally:
                await replicas.close()
            return polls[0]

    polls = asyncio.run(run())
    # Unbounded, 8 workers every 0.05 s would be ~320 polls in 2 s. At 20/s each is polled
    # every 0.4 s: at once, after a random share of one period, then every 0.36 s at least.
    assert 16 <= polls <= 8 * (2 + int(2.0 / 0.36)), polls


def test_event_context_holds_two_sockets_for_each_of_600_workers():
    ctx = event_context()  # libzmq's default context refuses the 1,024th socket
    sockets = []
    try:
        for _ in range(600):
            sockets += [ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)]
        assert len(sockets) == 1200
    finally:
        for s in sockets:
            s.close(linger=0)
        ctx.term()


def _ctx(reps: list[Replica], tokens: list[int], matched: dict) -> RouteContext:
    keys = block_keys(tokens, HashNamespace("demo", 16))
    return RouteContext(reps, keys, len(tokens), 16, matched, {}, keys[0])


def test_hits_name_only_the_replicas_holding_a_prefix():
    ns = HashNamespace("demo", block_size=4)
    index = BlockIndex()
    chains = {}
    for i in range(1000):  # each replica holds a chain of its own, of 3 blocks
        tokens = [i, i + 1, i + 2, i + 3] * 3
        keys = block_keys(tokens, ns)
        index.store(ReplicaId(f"r{i}"), ns, BlockStored(list(keys), None, tokens, 4))
        chains[i] = (tokens, keys)
    tokens, keys = chains[7]
    request = block_keys([*tokens, 99, 98, 97, 96], ns)  # the chain and one block more
    assert index.lookup.hits(request) == {"r7": 3}
    assert index.lookup.match(request, ["r7", "r8"]) == {"r7": 3, "r8": 0}
    index.speculate(ReplicaId("r9"), request[:2])  # a request was just routed to r9
    assert index.lookup.hits(request) == {"r7": 3, "r9": 2}
    assert index.lookup.hits(request, speculative=False) == {"r7": 3}
    index.drop_replica(ReplicaId("r7"))
    assert index.lookup.hits(request) == {"r9": 2}


def test_cache_aware_ranks_the_first_places_of_hundreds_of_replicas_exactly():
    policy = CacheAwarePolicy(GatewayConfig())
    rng = random.Random(3)
    reps = [Replica(ReplicaId(f"http://w{i}"), f"http://w{i}", healthy=True) for i in range(300)]
    half_life = GatewayConfig().recent_half_life
    for trial in range(30):
        now = time.monotonic()
        for r in reps:  # most idle, a few busy, recent prefill on some (or none: ties)
            r.in_flight = r.in_flight_prefill_tokens = 0
            r.running = r.waiting = 0.0
            r.recent_prefill, r.recent_at, r.recent_key = 0.0, 0.0, float("-inf")
            if trial % 3 and rng.random() < 0.5:
                r.add_recent_prefill(rng.randrange(1, 50) * 1000, now - rng.random(), half_life)
            if rng.random() < 0.05:
                r.in_flight = rng.randrange(1, 4)
                r.in_flight_prefill_tokens = rng.randrange(0, 3000)
            if rng.random() < 0.05:
                r.running = float(rng.randrange(0, 3))
        tokens = list(range(trial, trial + 2600))
        matched = {reps[i].id: rng.randrange(1, 160) for i in rng.sample(range(300), 3)}
        ctx = _ctx(reps, tokens, matched)
        ranked = policy.rank(ctx)
        assert sorted(map(id, ranked)) == sorted(map(id, reps))  # each candidate once
        later = time.monotonic()
        exact = sorted(
            reps, key=lambda r: (policy.cost(ctx, r, later, 1.0).total, tie_order(ctx.tie_seed, r))
        )
        assert ranked[:TOP] == exact[:TOP], trial


def test_a_healthy_worker_is_marked_down_only_after_three_unanswered_polls():
    async def run() -> None:
        config = FleetConfig(replicas=1, num_blocks=20, timing=Timing(0.0, 0.0, 0.0))
        async with Fleet(config) as fleet, httpx.AsyncClient() as http:
            url, sim = fleet.urls[0], fleet.replicas[0]
            gw = GatewayConfig(connect_timeout=0.2)
            index = BlockIndex()
            replicas = ReplicaSet(gw, index, GatewayMetrics(), http)
            rep = replicas.replicas[ReplicaId(url)] = Replica(ReplicaId(url), url)
            try:
                await replicas.poll_once(rep)
                assert rep.healthy and rep.link.subscriber is not None
                await asyncio.wait_for(rep.link.subscriber.synced.wait(), 10)  # its snapshot loaded
                tokens = list(range(16))
                index.store(rep.id, sim.model.namespace, BlockStored([b"k"], None, tokens, 16))
                answer = sim._routes[("GET", "/kvgate/info")]
                sim._routes[("GET", "/kvgate/info")] = lambda ex: None  # never answered
                for failed in (1, 2):
                    await replicas.poll_once(rep)  # no answer in 0.4 s
                    assert rep.healthy and rep.health.failed_polls == failed
                    assert index.lookup.replica_blocks(rep.id) == 1  # its index entries kept
                await replicas.poll_once(rep)
                assert (
                    not rep.healthy and rep.health.down_reason == "unreachable: no answer in 0.4s"
                )
                assert index.lookup.replica_blocks(rep.id) == 0
                sim._routes[("GET", "/kvgate/info")] = answer
                await replicas.poll_once(rep)
                assert rep.healthy and rep.health.failed_polls == 0
            finally:
                await replicas.close()

    asyncio.run(run())
