"""Cold placements agree without a message: two gateway processes that share nothing (no peers,
no KV events) choose the same replica for each new prefix, because equal candidates are ordered
by a rendezvous hash of the request's first block key (routing/policies/base.py, `tie_order`)."""

from __future__ import annotations

import time

import pytest

from harness.cluster import Cluster, ClusterSpec
from tests.support.chat import chat_body, post, user

POLL_S = 0.1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=4,
        gateways=2,
        engine="sim",
        num_blocks=256,
        gateway_args=("--no-kv-events", "--poll-interval", str(POLL_S)),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=90,
    )
    with Cluster(spec) as c:
        yield c


def test_two_gateways_that_never_spoke_place_new_prefixes_alike(cluster: Cluster) -> None:
    a, b = (g.url for g in cluster.gateways)
    chosen = []
    for i in range(8):
        body = chat_body(user(f"tenant {i} " + " ".join(f"t{i}w{j}" for j in range(60))))
        # Each decision after both gateways' polls see the replicas idle again: the same load
        # on both sides (a poll during the other's request would see it running).
        time.sleep(3 * POLL_S)
        first = post(a, body)
        time.sleep(3 * POLL_S)
        second = post(b, body)
        assert first.status_code == second.status_code == 200, (first.text, second.text)
        assert cluster.served_by(first) == cluster.served_by(second), i
        chosen.append(cluster.served_by(first))
    assert len(set(chosen)) > 1  # the prefix orders them: new prefixes spread over the replicas
