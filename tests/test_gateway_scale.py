"""What fronting hundreds of workers takes: polls and event tail checks within their rate however
many workers (gateway/pace.py, measured on real polls of a simulated fleet), and a ZMQ context
that holds a SUB and a replay DEALER for each of them."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import zmq

from gateway.config import GatewayConfig
from gateway.index import BlockIndex
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
