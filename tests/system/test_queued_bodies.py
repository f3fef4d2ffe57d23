"""The bodies of requests waiting for a slot count in `--body-read-budget` with those being read:
a real gateway whose one worker slot is taken queues large requests only until their bodies fill
the budget, then refuses the next (429), and takes them again once the queue has moved. Before,
a body read whole left the budget, and the admission queue (`--max-queue`, 1,024) could hold
that many bodies of `--max-body-bytes` each."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from tests.support.chat import CHAT, chat_body, user

pytestmark = [pytest.mark.slow, pytest.mark.long]  # whole clusters under faults: make test-long

MAX_BODY = 2**20
PAD = 900_000  # bytes of an ignored field: three such bodies fit the budget, four do not
GATEWAY = (
    "--poll-interval", "0.2",
    "--max-body-bytes", f"{MAX_BODY}",
    "--body-read-budget", f"{3 * MAX_BODY}",
    "--max-inflight-per-replica", "1",
    "--max-queue", "100",
)  # fmt: skip


def _padded(text: str) -> dict:
    return {**chat_body(user(text), max_tokens=2), "padding": "x" * PAD}


def test_queued_bodies_fill_the_budget(tmp_path) -> None:
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=256,
        worker_args=("--sim-decode-s-per-step", "0.05"),
        gateway_args=GATEWAY,
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        url = c.gateway_url + CHAT
        codes: list[int] = []

        def send(body: dict) -> None:
            codes.append(httpx.post(url, json=body, timeout=60).status_code)

        # The one slot, for about 5 s (100 steps of 0.05 s).
        slot = {**chat_body(user("a long answer"), max_tokens=100), "ignore_eos": True}
        threads = [threading.Thread(target=send, args=(slot,))]
        threads += [threading.Thread(target=send, args=(_padded(f"q{i}"),)) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.2)  # the long one first; the others queue behind it
        time.sleep(1.0)
        refused = httpx.post(url, json=_padded("one more"), timeout=60)
        assert refused.status_code == 429, refused.text
        assert "--body-read-budget" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
        small = httpx.post(url, json=chat_body(user("small"), max_tokens=2), timeout=60)
        assert small.status_code == 200, small.text  # a small body still fits: it waits its turn
        for t in threads:
            t.join(60)
        assert codes == [200] * 4, codes
        # The queue moved on: the budget is free again.
        again = httpx.post(url, json=_padded("again"), timeout=60)
        assert again.status_code == 200, again.text
