"""harness/floor.py: the start-up floor of a closed-loop run, which no policy can beat."""

from __future__ import annotations

import pytest

from harness.floor import startup_floor


def test_start_up_floor_of_the_opening_burst():
    """14 tenants of ~2,450-token prompts over 4 replicas: two replicas take 4 full prefills
    (1.96 s at 200 us/token); with 8-token answers all 4 there end after the last one, which
    is 8 requests, more than the 2 a nearest-rank p99 of 288 lets go."""
    opening = [(f"t{i}", 2450) for i in range(14)] + [("t0", 2500), ("t1", 2400)]
    fl = startup_floor(opening, 288, 4, 0.0002, max_tokens=8, step_tokens=2048)
    assert (fl.tenants, fl.per_replica, fl.busiest) == (14, 4, 2)
    assert fl.seconds == pytest.approx((2400 + 3 * 2450) * 0.0002)  # the 4 cheapest tenants
    assert fl.requests == 8 and fl.binds_p99
    # One-token answers do not wait for the other prefills: only the last on each replica does.
    short = startup_floor(opening, 288, 4, 0.0002, max_tokens=1, step_tokens=2048)
    assert short.requests == 2 and not short.binds_p99
    # As many tenants as replicas: one prefill each, no floor beyond a single prefill.
    assert startup_floor(opening[:4], 288, 4, 0.0002, 8, 2048).per_replica == 1
