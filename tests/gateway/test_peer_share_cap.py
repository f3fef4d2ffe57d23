"""The in-flight cap across four real gateway processes (`--peer-admission shares`, the
default): closed-loop clients on every gateway ask for more than the workers' slots, and what
each worker really holds (its running plus waiting requests, harness/worker_load.py) never
exceeds `--max-inflight-per-replica`. With the other three gateways killed, the one left takes
the whole cap again after `--peer-timeout`: a dead peer never holds a slot back."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.worker_load import LoadSampler
from tests.support.chat import chat_body, user

TOKEN = "peer-share-test-token-0123456789"
CAP = 4
PEER_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=2,
        gateways=4,
        peers=True,
        engine="sim",
        worker_token=TOKEN,
        worker_args=("--sim-decode-s-per-step", "0.05"),
        gateway_args=tuple(
            f"--poll-interval=0.2 --max-inflight-per-replica={CAP} --max-queue=1000 "
            f"--queue-timeout=60 --peer-timeout={PEER_TIMEOUT}".split()
        ),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=120,
    )
    with Cluster(spec) as c:
        yield c


def _clients(
    gateways: list[str], per_gateway: int, seconds: float, filled: Callable[[], bool]
) -> list[int]:
    """Closed-loop clients, `per_gateway` on each gateway, for `seconds` and then until
    `filled()` (the slots seen full: on a busy host that can take longer), 30 s at most: every
    status code they got."""
    start = time.monotonic()

    def going() -> bool:
        spent = time.monotonic() - start
        return spent < seconds or (spent < 30 and not filled())

    def loop(gw: str, k: int) -> list[int]:
        codes = []
        with httpx.Client(timeout=60) as client:
            i = 0
            while going():
                i += 1
                body = chat_body(user(f"{gw} client {k} request {i}"), max_tokens=6)
                body["ignore_eos"] = True
                codes.append(client.post(f"{gw}/v1/chat/completions", json=body).status_code)
        return codes

    with ThreadPoolExecutor(len(gateways) * per_gateway) as pool:
        futures = [pool.submit(loop, gw, k) for gw in gateways for k in range(per_gateway)]
        return [code for f in futures for code in f.result()]


def test_the_cap_holds_across_four_gateways(cluster: Cluster) -> None:
    gateways = [g.url for g in cluster.gateways]
    with LoadSampler(cluster.worker_urls, TOKEN) as sampler:
        # 16 clients for 2 x 4 slots: every gateway keeps requests waiting for a slot.
        codes = _clients(gateways, 4, 4.0, lambda: sampler.peak == CAP)
    assert codes and set(codes) == {200}, sorted(set(codes))
    assert sampler.peak <= CAP, f"a worker held {sampler.peak} > {CAP}: {sampler.peaks}"
    assert sampler.peak == CAP  # the clients did fill the slots (the check above means something)


def test_alone_a_gateway_takes_the_whole_cap_again(cluster: Cluster) -> None:
    for g in cluster.gateways[1:]:
        g.kill(signal.SIGKILL)
    time.sleep(PEER_TIMEOUT + 0.5)  # the dead peers expire: their shares come back
    with LoadSampler(cluster.worker_urls, TOKEN) as sampler:
        codes = _clients(
            [cluster.gateways[0].url], 12, 3.0, lambda: set(sampler.peaks.values()) == {CAP}
        )
    assert codes and set(codes) == {200}, sorted(set(codes))
    assert sampler.peaks == dict.fromkeys(cluster.worker_urls, CAP), sampler.peaks
