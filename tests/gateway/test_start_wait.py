"""A gateway that has not polled its workers yet (just started or restarted): `/ready` stays 503
`starting`, and a request that reaches it anyway (a client or balancer that does not read
`/ready`) waits up to `--start-wait` for the first polls, then is served, or refused 503
`starting` with Retry-After when the polls take longer.

One real sim worker, stopped (SIGSTOP) while two real gateway processes start on it: their first
poll connects and waits for an answer the worker gives only once it is continued (SIGCONT).
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.ports import HOST, free_port
from harness.proc import Proc
from harness.waits import wait_until
from tests.support.chat import chat_body, user

pytestmark = pytest.mark.slow

SHORT_WAIT = 0.5  # --start-wait of the gateway that gives up
LONG_WAIT = 8.0  # --start-wait of the gateway that waits


def _gateway(worker: str, wait: float, log_dir) -> Proc:
    port = free_port()
    args = ["-m", "gateway", "--workers", worker, "--host", HOST, "--port", str(port)]
    args += ["--poll-interval", "0.2", "--start-wait", str(wait)]
    return Proc(f"gateway-wait{wait:g}", args, port, log_dir / f"gateway-{wait:g}.log")


def _status(g: Proc, path: str) -> int | None:
    try:
        return httpx.get(f"{g.url}{path}", timeout=5).status_code
    except httpx.HTTPError:
        return None


def _chat(g: Proc) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(
        f"{g.url}/v1/chat/completions",
        json=chat_body(user("are you there yet?"), max_tokens=2),
        timeout=30,
    )
    return r, time.monotonic() - t0


def test_a_request_before_the_first_poll_waits_for_it_or_gets_a_retry_after(tmp_path) -> None:
    spec = ClusterSpec(workers=1, gateways=0, engine="sim", log_dir=tmp_path, startup_timeout=90)
    with Cluster(spec) as c:
        worker = c.workers[0]
        assert worker.pid is not None
        gws = [_gateway(c.worker_urls[0], w, tmp_path) for w in (SHORT_WAIT, LONG_WAIT)]
        os.kill(worker.pid, signal.SIGSTOP)  # its listener still queues the polls
        stopped = True
        try:
            for g in gws:
                g.start()
            for g in gws:
                wait_until(lambda g=g: _status(g, "/ready") is not None, 60, f"{g.name} listens")
                assert _status(g, "/ready") == 503  # not polled: takes no traffic
            short, long_ = gws
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(_chat, long_)  # held for the first poll
                refused, took = _chat(short)
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "starting"
                assert refused.headers["retry-after"] == "1"
                assert SHORT_WAIT * 0.9 <= took < SHORT_WAIT + 3.0
                assert not waiting.done()
                os.kill(worker.pid, signal.SIGCONT)
                stopped = False
                served, took = waiting.result(timeout=30)
            assert served.status_code == 200, served.text
            assert took < LONG_WAIT  # served once polled, not at the end of the wait
            for g in gws:
                assert _status(g, "/ready") == 200
            r, _ = _chat(short)  # started: served as any request
            assert r.status_code == 200, r.text
        finally:
            if stopped:
                os.kill(worker.pid, signal.SIGCONT)
            for g in gws:
                g.kill()
