"""What fronting hundreds of workers takes: polls and event tail checks within their rate however
many workers (gateway/pace.py, measured on real polls of a simulated fleet), a ZMQ context
that holds a SUB and a replay DEALER for each of them, and a match that looks only at the
replicas holding a request's prefix."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import zmq

from cachekey.events import BlockStored
from cachekey.keys import HashNamespace, block_keys
from gateway.config import GatewayConfig
from gateway.index import BlockIndex, ReplicaId
from gateway.metrics import GatewayMetrics
from gateway.pace import Pace
from gateway.rank_events import event_context
from gateway.replicas import ReplicaSet
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
                await replicas.set_urls(frozenset(fleet.urls))
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
    assert index.hits(request) == {"r7": 3}
    assert index.match(request, ["r7", "r8"]) == {"r7": 3, "r8": 0}
    index.add_speculative(ReplicaId("r9"), request[:2])  # a request was just routed to r9
    assert index.hits(request) == {"r7": 3, "r9": 2}
    assert index.hits(request, speculative=False) == {"r7": 3}
    index.drop_replica(ReplicaId("r7"))
    assert index.hits(request) == {"r9": 2}
