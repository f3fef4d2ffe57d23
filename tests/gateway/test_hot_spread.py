"""A hot prefix spreads without thrash: through a real gateway (cache_aware) and three sim
workers timed like the GPU, one system prompt that every user shares, sent concurrently, gets
new holders while its holders are busier than a replica recomputing it would be, each replica
takes it once (no prefix moves back and forth), and its traffic then spreads over them."""

from __future__ import annotations

import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from tests.support.chat import CHAT, chat_body

WORKERS = 3
CONCURRENCY = 12
REQUESTS = 60
SYSTEM = "You are the one application's assistant; answer briefly and politely. " * 30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=WORKERS,
        engine="sim",
        num_blocks=512,
        worker_args=("--sim-preset", "h200-llama-1b", "--sim-time-scale", "2"),
        # The busy term is off by default (docs/gateway.md); without it all 60 requests stayed
        # on the first holder.
        gateway_args=("--poll-interval", "0.2", "--busy-weight", "0.5"),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        yield c


def _ask(c: Cluster, i: int) -> tuple[str, int, int]:
    """One user's question after the shared system prompt: the worker that served it, the
    cached tokens the gateway predicted there, and its prompt tokens."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"user {i}"}]
    r = httpx.post(f"{c.gateway_url}{CHAT}", json=chat_body(messages, max_tokens=48), timeout=60)
    assert r.status_code == 200, r.text
    predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
    return c.served_by(r), predicted, r.json()["usage"]["prompt_tokens"]


def test_hot_prefix_spreads_over_holders_without_thrash(cluster: Cluster):
    first, predicted, prompt = _ask(cluster, -1)  # one replica holds the prefix
    assert predicted == 0 and prompt > 300
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        served = list(pool.map(lambda i: _ask(cluster, i), range(REQUESTS)))
    # New holders: the requests sent where nothing of the prefix was held (or guessed).
    recomputed = [url for url, predicted, _ in served if predicted == 0]
    assert first not in recomputed
    assert len(recomputed) == len(set(recomputed)), recomputed  # each replica took it once
    counts = Counter(url for url, _, _ in served)
    assert len(counts) == WORKERS, counts  # the prefix spread to every replica...
    assert max(counts.values()) <= 1.5 * REQUESTS / WORKERS, counts  # ...and its traffic too
    # Once held everywhere it stays: one at a time, every request is a hit where it lands.
    later = [_ask(cluster, REQUESTS + i) for i in range(2 * WORKERS)]
    assert all(predicted > 0 for _, predicted, _ in later), later
    # Every request gave back the context it was charged (the busy term's count).
    metrics = httpx.get(f"{cluster.gateway_url}/metrics", timeout=10).text
    held = re.findall(r"^kvgate_in_flight_tokens\{replica=\"[^\"]+\"\} (\S+)$", metrics, re.M)
    assert len(held) == WORKERS and all(float(v) == 0 for v in held), held
