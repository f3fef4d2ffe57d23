"""The gateway predicts each worker's hit with the worker's own rule for a match that ends inside
an image (`/kvgate/info` `mm_match_rule`): real `python -m worker --engine sim` processes, one
keeping such a match (partial, the default) and one rewinding it (clamp), and a real gateway."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from cachekey import Renderer
from cachekey.assets import ModelAssets
from harness.cluster import Cluster, ClusterSpec
from harness.waits import wait_index_converged
from harness.workload import data_url, make_image
from tests.support.chat import chat

BS = 16
SYSTEM = "You describe pictures for an image archive. Be brief and precise. " * 3
RULES = ("clamp", "partial")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=512,
        per_worker_args=[("--mm-match-rule", rule) for rule in RULES],
        gateway_args=("--poll-interval", "0.2"),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        deadline = time.monotonic() + 20
        while True:
            reps = httpx.get(f"{c.gateway_url}/kvgate/index").json()["replicas"].values()
            if len(reps) == 2 and all(r["synced"] and r["healthy"] for r in reps):
                break
            assert time.monotonic() < deadline, reps
            time.sleep(0.1)
        yield c


def messages(image: str, question: str) -> list[dict]:
    content = [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": question},
    ]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]


def round_robin(cluster: Cluster, msgs: list[dict]) -> tuple[str, int, int]:
    """Round robin: sequential requests alternate between the two workers."""
    headers = {"x-kvgate-routing-policy": "round_robin"}
    r = chat(cluster.gateway_url, msgs, headers, temperature=0.0)
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cluster.served_by(r), int(r.headers["x-kvgate-predicted-cached-tokens"]), cached


def test_each_worker_is_predicted_with_its_own_rule(cluster: Cluster, demo_model_dir: Path) -> None:
    infos = [httpx.get(f"{url}/kvgate/info").json() for url in cluster.worker_urls]
    assert [info["mm_match_rule"] for info in infos] == list(RULES)
    rule_of = dict(zip(cluster.worker_urls, RULES, strict=True))
    renderer = Renderer(ModelAssets.from_dir(demo_model_dir))
    seen: dict[str, list[int]] = {rule: [] for rule in RULES}
    for seed in (1, 2):
        image = data_url(make_image(500 + seed))
        for _ in RULES:  # one warm-up on each worker
            worker, predicted, cached = round_robin(
                cluster, messages(image, "What is in this picture?")
            )
            assert predicted == cached
        wait_index_converged(cluster.gateway_url, cluster.worker_urls)
        probe = messages(image, "Which colours does it use, and where?")
        (item,) = renderer.render_chat(probe).mm_items
        for _ in RULES:  # the same image, another question, on each worker
            worker, predicted, cached = round_robin(cluster, probe)
            assert predicted == cached, (rule_of[worker], predicted, cached)
            seen[rule_of[worker]].append(cached)
            if rule_of[worker] == "clamp":
                assert cached == (item.offset // BS) * BS
            else:
                assert item.offset < cached < item.end  # the match ends inside the image
        # Another image on the same text: each worker hits the text before it only (ATOM #1358).
        other = messages(data_url(make_image(900 + seed)), "What is in this picture?")
        for _ in RULES:
            worker, predicted, cached = round_robin(cluster, other)
            assert predicted == cached == (item.offset // BS) * BS
    assert all(len(hits) == 2 for hits in seen.values()), seen  # both rules were exercised
