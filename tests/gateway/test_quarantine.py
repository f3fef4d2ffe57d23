"""gateway/quarantine.py: the bodies of requests that killed engines, held for `--poison-ttl`."""

from __future__ import annotations

import time

from gateway.quarantine import MAX_HELD, Quarantine


def test_a_held_body_is_refused_until_its_time_is_up() -> None:
    q = Quarantine(0.2)
    assert not q.holds(b"x")
    q.hold(b"x")
    assert q.holds(b"x") and not q.holds(b"y")
    time.sleep(0.25)
    assert not q.holds(b"x")
    assert not q._until  # expired entries go: a quarantine that held nothing hashes nothing


def test_no_ttl_holds_nothing() -> None:
    q = Quarantine(0.0)
    q.hold(b"x")
    assert not q.holds(b"x")


def test_the_oldest_goes_past_the_bound() -> None:
    q = Quarantine(60.0)
    for i in range(MAX_HELD + 1):
        q.hold(b"%d" % i)
    assert not q.holds(b"0") and q.holds(b"1") and q.holds(b"%d" % MAX_HELD)
    q.hold(b"1")  # held again: it expires last, so it is not the next to go
    q.hold(b"new")
    assert q.holds(b"1") and not q.holds(b"2")
