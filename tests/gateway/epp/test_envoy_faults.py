"""Faults behind a real Envoy: a picked worker that is gone, and the EPP itself gone.

- override_host with --epp-fallbacks and Envoy retries: the pick refuses the connection, Envoy
  walks the list, and the EPP counts the request where Envoy served it.
- ORIGINAL_DST with one endpoint: Envoy answers 503 itself; the EPP neither stamps the answer
  with a replica and a predicted hit nor counts it as routed there.
- FailClose: with the EPP dead, Envoy answers 500 at once. FailOpen: Envoy routes without it
  (ORIGINAL_DST has no destination then: 503; override_host falls back to round robin), and the
  Gateway's own header stripping keeps a client from steering the bypassed request.
- The EPP killed mid-run: no request hangs; each ends with an answer.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.envoy import Envoy
from harness.envoy_config import EnvoySpec
from harness.ports import HOST
from tests.support.chat import chat, user
from tests.support.epp import TOKEN, ep, start_epp

pytestmark = [pytest.mark.slow, pytest.mark.long]

CHAT = "/v1/chat/completions"


@pytest.fixture
def three(tmp_path):
    spec = ClusterSpec(workers=3, engine="sim", num_blocks=256, gateways=0, worker_token=TOKEN,
                       log_dir=tmp_path, startup_timeout=60)  # fmt: skip
    with Cluster(spec) as c:
        yield c, tmp_path


def ask(envoy: Envoy, text: str, tag: str, **headers: str) -> httpx.Response:
    """A short chat through Envoy, tagged for its access log."""
    return chat(envoy.url, user(text), {"x-test-tag": tag, **headers}, timeout=30)


def requests_at(epp_url: str, replica: str, status: str | None = None) -> float:
    """kvgate_requests_total of one replica, by its name (one status of it, when given)."""
    total = 0.0
    for line in httpx.get(f"{epp_url}/metrics", timeout=10).text.splitlines():
        if not line.startswith("kvgate_requests_total{"):
            continue
        labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")]
                      .replace('"', "").split(","))  # fmt: skip
        if labels["replica"] == replica and status in (None, labels["status"]):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_picked_worker_gone(three) -> None:
    c, log_dir = three
    # A slow poll: the EPP still believes in the dead worker when the next request comes.
    slow = ("--poll-interval", "30", "--event-tail-check-interval", "30")
    text = "a prefix that lives on one worker " * 20
    with_list, wl_target = start_epp(c, log_dir, "epp-list", *slow, "--epp-fallbacks", "2")
    single, s_target = start_epp(c, log_dir, "epp-single", *slow)
    specs = {
        "list": EnvoySpec(epp=wl_target, workers=c.worker_urls, lb="override_host", retries=2,
                          log_dir=log_dir),
        "single": EnvoySpec(epp=s_target, workers=c.worker_urls, log_dir=log_dir),
    }  # fmt: skip
    try:
        with (
            Envoy(specs["list"], name="envoy-list") as lst,
            Envoy(specs["single"], name="envoy-one") as one,
        ):
            assert ask(lst, text, "warm-list").status_code == 200
            home = lst.logged("warm-list")["upstream"]
            assert ask(one, text, "warm-one").status_code == 200
            assert one.logged("warm-one")["upstream"] == home  # the same index, the same pick
            dead = next(w for w in c.workers if ep(w.url) == home)
            dead.kill(signal.SIGKILL)
            gone = c.replica_name(dead.url)  # its name: the requests' `replica` label

            # override_host walks the list: served by the next endpoint, counted there.
            r = ask(lst, text, "after-list")
            entry = lst.logged("after-list")
            assert r.status_code == 200 and entry["upstream"] != home, entry
            served = next(u for u in c.worker_urls if ep(u) == entry["upstream"])
            assert r.headers["x-kvgate-replica"] == c.replica_name(served)
            assert requests_at(with_list.url, gone, "200") == 1  # only the warm-up
            assert requests_at(with_list.url, gone, "retried") == 1  # the failed pick
            assert requests_at(with_list.url, c.replica_name(served), "200") == 1

            # ORIGINAL_DST, one endpoint: Envoy's own 503 is not the worker's answer.
            r = ask(one, text, "after-one")
            entry = one.logged("after-one")
            assert r.status_code == 503 and entry["flags"] == "UF", entry
            assert "x-kvgate-replica" not in r.headers
            assert "x-kvgate-predicted-cached-tokens" not in r.headers
            assert requests_at(single.url, gone, "200") == 1  # only the warm-up
            assert requests_at(single.url, "none", "503") == 1  # answered by the proxy
            retried = requests_at(single.url, gone, "retried")
            assert retried == 1  # the failure reached the circuit breaker
    finally:
        with_list.kill()
        single.kill()


def test_fail_close_and_the_epp_killed_mid_run(three) -> None:
    c, log_dir = three
    epp, target = start_epp(c, log_dir, "epp")
    spec = EnvoySpec(epp=target, workers=c.worker_urls, message_timeout_s=5, log_dir=log_dir)
    try:
        with Envoy(spec, name="envoy-close") as envoy:
            stop = threading.Event()
            ended: list[int] = []

            def load() -> None:  # requests in flight while the EPP dies
                i = 0
                while not stop.is_set():
                    i += 1
                    ended.append(ask(envoy, f"load {i} " * 40, f"load-{i}").status_code)

            t = threading.Thread(target=load)
            t.start()
            time.sleep(1.0)
            epp.kill(signal.SIGKILL)
            time.sleep(0.5)
            stop.set()
            t.join(20)
            assert not t.is_alive()  # every request in flight ended: none hung
            assert 200 in ended and set(ended) <= {200, 500}, ended
            t0 = time.monotonic()
            r = ask(envoy, "after " * 30, "after")
            assert r.status_code == 500 and time.monotonic() - t0 < 2.0  # FailClose, at once
    finally:
        epp.kill()


def test_fail_open(three) -> None:
    """FailOpen, as docs/kubernetes.md says: with the EPP scaled to zero Envoy routes on its own
    (ORIGINAL_DST has no destination: 503; override_host's round robin reaches a worker, which
    refuses a request without the worker token: 401), the client's own destination header
    stripped by the Gateway. With the EPP process dead in FULL_DUPLEX_STREAMED, a request whose
    body Envoy already streamed to it cannot be routed: 500, never a hang."""
    c, log_dir = three
    other = ep(c.worker_urls[1])
    forged = {"x-gateway-destination-endpoint": other}
    shapes = {
        lb: EnvoySpec(epp="", workers=c.worker_urls, lb=lb, failure_mode_allow=True,
                      log_dir=log_dir)
        for lb in ("original_dst", "override_host")
    }  # fmt: skip
    with Envoy(shapes["original_dst"], name="envoy-zero-odst") as odst:
        r = ask(odst, "no epp " * 30, "odst", **forged)
        assert r.status_code == 503 and odst.logged("odst")["upstream"] is None
    with Envoy(shapes["override_host"], name="envoy-zero-oh") as oh:
        r = ask(oh, "no epp " * 30, "oh", **forged)
        assert r.status_code == 401 and "x-kvgate-replica" not in r.headers
    epp, target = start_epp(c, log_dir, "epp")
    epp.kill(signal.SIGKILL)
    spec = EnvoySpec(epp=target, failure_mode_allow=True, message_timeout_s=5, log_dir=log_dir)
    with Envoy(spec, name="envoy-dead") as dead:
        t0 = time.monotonic()
        r = ask(dead, "dead epp " * 30, "dead", **forged)
        assert r.status_code in (500, 503) and time.monotonic() - t0 < 5.0
        assert dead.logged("dead")["upstream"] != other


def test_without_stripping_a_bypassed_request_is_steered(three) -> None:
    """What docs/kubernetes.md warns about: FailOpen, the EPP scaled to zero, and no
    Gateway-side stripping of `x-gateway-destination-endpoint`: the client chooses the worker
    (which refuses it here only because it wants the worker token)."""
    c, log_dir = three
    spec = EnvoySpec(epp="", failure_mode_allow=True, strip_client_headers=False,
                     log_dir=log_dir)  # fmt: skip
    with Envoy(spec, name="envoy-nostrip") as envoy:
        chosen = ep(c.worker_urls[2])
        r = ask(envoy, "steer me " * 20, "steer", **{"x-gateway-destination-endpoint": chosen})
        assert r.status_code == 401 and envoy.logged("steer")["upstream"] == chosen
    assert HOST in chosen
