"""The plumbing of bench.fleet_scale: open-loop arrivals against real replicas (conversation
order, keep-alive, usage read back), and quantiles of Prometheus histograms between scrapes."""

from __future__ import annotations

import asyncio
import json

import pytest

from harness.fleet.engine import Timing
from harness.fleet.fleet import Fleet, FleetConfig
from harness.open_loop import TraceRequest, arrival_times, run_open_loop
from harness.prom import Scrape, combined, delta, quantile


def test_arrivals_are_poisson_at_the_rate():
    times = arrival_times(20_000, 50.0, seed=1)
    assert times[0] == 0 and times == sorted(times)
    assert len(times) / times[-1] == pytest.approx(50.0, rel=0.03)
    assert arrival_times(5, 50.0, seed=1) == times[:5]  # seeded


def _body(conversation: int, turn: int) -> bytes:
    msgs = [{"role": "system", "content": f"Tenant {conversation}. " + "cache " * 60}]
    for t in range(turn + 1):
        msgs.append({"role": "user", "content": f"turn {t}"})
        if t < turn:
            msgs.append({"role": "assistant", "content": "ok"})
    return json.dumps({"model": "demo", "messages": msgs, "max_tokens": 3}).encode()


def test_open_loop_keeps_each_conversation_in_order_and_reads_usage():
    # Two replicas taking 50 ms per request: at 200 requests/s a conversation's next turn is due
    # before its previous one is answered, so it must wait for it.
    trace = [TraceRequest(c, _body(c, t)) for t in range(3) for c in range(4)]

    async def run():
        timing = Timing(prefill_s_per_token=0.0, decode_s_per_step=0.025, step_s=0.0)
        async with Fleet(FleetConfig(replicas=2, num_blocks=200, timing=timing)) as fleet:
            return await run_open_loop(fleet.urls, trace, rate=200.0, seed=3)

    outcomes = asyncio.run(run())
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    for i, (req, out) in enumerate(zip(trace, outcomes, strict=True)):
        assert out.prompt_tokens > 0 and out.done > out.sent >= out.due
        before = [outcomes[j] for j in range(i) if trace[j].conversation == req.conversation]
        assert all(out.sent >= b.done for b in before)  # sent once its previous turn ended
    # Request i goes to replica i % 2, so every turn of a conversation to the same one: its
    # third turn finds the prefix of the first two cached.
    third = outcomes[8:]
    assert any(o.cached_tokens > 0 for o in third)


def test_histogram_quantile_between_two_scrapes():
    page = """# TYPE h histogram
h_bucket{le="0.001",x="a"} 1
h_bucket{le="0.01",x="a"} 3
h_bucket{le="0.1",x="a"} 4
h_bucket{le="+Inf",x="a"} 4
h_count{x="a"} 4
c_total{replica="r1"} 2
c_total{replica="r2"} 3
"""
    later = page.replace(" 4\n", " 14\n")  # 10 more, all in the (0.01, 0.1] bucket
    before, after = Scrape.parse(page), Scrape.parse(later)
    assert before.total("c_total") == 5.0
    both = combined([before, before])
    assert both.buckets["h"][0.01] == 6 and both.total("c_total") == 10
    d = delta(after, before)
    # Between the scrapes 10 observations landed in (0.01, 0.1]: every quantile is in there.
    assert 0.01 < quantile(d, "h", 0.5) <= 0.1
    assert quantile(d, "h", 0.99) == pytest.approx(0.01 + 0.09 * 0.99)
    assert quantile(before, "h", 0.25) == pytest.approx(0.001)
    assert quantile(d, "missing", 0.5) is None
