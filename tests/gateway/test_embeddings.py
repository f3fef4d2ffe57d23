"""Embeddings and return_hidden_states through the gateway: routed by the completion keys, with
predicted cached tokens equal to what the workers report (real sim workers, real gateway)."""

from __future__ import annotations

import base64
import random

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.waits import wait_index_converged
from harness.workload import data_url, make_image
from tests.support.chat import post

WORDS = "cache block prefix route model token image worker gateway replica tenant".split()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=3,
        engine="sim",
        num_blocks=512,
        worker_args=("--hidden-state-cache",),
        gateway_args=("--poll-interval", "0.2"),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        wait_index_converged(c.gateway_url, c.worker_urls)
        yield c


def doc(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def settled(cluster: Cluster, path: str, body: dict) -> httpx.Response:
    """A request for the demo model, once its blocks are in the index (the next one sees them)."""
    r = post(cluster.gateway_url, {"model": "demo", **body}, path)
    wait_index_converged(cluster.gateway_url, cluster.worker_urls)
    return r


def prediction(r: httpx.Response) -> tuple[int, int]:
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(r.headers["x-kvgate-predicted-cached-tokens"]), cached


def test_predicted_equals_reported_and_prefixes_stick(cluster: Cluster) -> None:
    rng = random.Random(5)
    prefixes = [doc(rng, 150) for _ in range(3)]
    placed: dict[int, set[str]] = {g: set() for g in range(3)}
    hits = 0
    for i in range(12):
        group = i % 3
        body = {"input": prefixes[group] + " " + doc(rng, 12), "pooling": "mean"}
        r = settled(cluster, "/v1/embeddings", body)
        predicted, cached = prediction(r)
        assert predicted == cached, (i, predicted, cached)
        hits += cached > 0
        placed[group].add(r.headers["x-kvgate-replica"])
    assert hits >= 9  # every request after its group's first hits the shared prefix
    assert all(len(replicas) == 1 for replicas in placed.values()), placed


def test_batches_predict_every_input(cluster: Cluster) -> None:
    rng = random.Random(9)
    a, b = doc(rng, 120), doc(rng, 120)
    prediction(settled(cluster, "/v1/embeddings", {"input": a + " first"}))
    prediction(settled(cluster, "/v1/embeddings", {"input": b + " first"}))
    # Both prefixes are cached (maybe on different replicas): the batch lands on one, and its
    # prediction adds up what each input finds there, as the worker's usage does.
    inputs = [a + " second", b + " second", doc(rng, 40)]
    r = settled(cluster, "/v1/embeddings", {"input": inputs, "encoding_format": "base64"})
    predicted, cached = prediction(r)
    assert predicted == cached > 0
    assert [d["index"] for d in r.json()["data"]] == [0, 1, 2]
    assert all(isinstance(d["embedding"], str) for d in r.json()["data"])


def test_image_messages(cluster: Cluster) -> None:
    url = data_url(make_image(42))

    def messages(question: str) -> list[dict]:
        content = [
            {"type": "text", "text": "Describe what you see in this picture in detail."},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Then consider every part of it and answer: " + question},
        ]
        return [{"role": "user", "content": content}]

    first = prediction(settled(cluster, "/v1/embeddings", {"messages": messages("colour?")}))
    second = prediction(settled(cluster, "/v1/embeddings", {"messages": messages("shape?")}))
    assert first[0] == first[1] and second[0] == second[1] > 64  # the image is in the hit


def test_return_hidden_states_through_the_gateway(cluster: Cluster) -> None:
    rng = random.Random(11)
    prompt = doc(rng, 100)
    body = {"prompt": prompt, "max_tokens": 3, "return_hidden_states": True}
    prediction(settled(cluster, "/v1/completions", body))
    r = settled(cluster, "/v1/completions", body)
    predicted, cached = prediction(r)
    assert predicted == cached > 0
    h = r.json()["choices"][0]["hidden_states"]
    usage = r.json()["usage"]
    rows, tokens, hidden = h["shape"]
    assert tokens == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert len(base64.b64decode(h["data"])) == 4 * rows * tokens * hidden


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": "x", "stream": True}, "stream", "embeddings are not streamed"),
        (
            {"input": "x", "messages": [{"role": "user", "content": "y"}]},
            None,
            "give exactly one of `input` and `messages`",
        ),
        ({"input": ["x"] * 2049}, None, "input has 2049 items; at most 2048 are allowed"),
        ({"input": [[7]] * 2049}, None, "input has 2049 items; at most 2048 are allowed"),
        ([{"input": "x"}], None, "The request body must be a JSON object, not an array."),
    ],
)
def test_refused_at_the_gateway(cluster: Cluster, body: dict, param: str | None, says: str) -> None:
    r = httpx.post(f"{cluster.gateway_url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert says in r.json()["error"]["message"]


def test_one_prompt_of_many_token_ids_is_one_input(cluster: Cluster) -> None:
    """OpenAI's 2,048-input limit counts prompts: a single prompt given as 3,000 token ids is
    one input (the gateway once refused it as 3,000 items)."""
    body = {"input": [7] * 3000}
    r = httpx.post(f"{cluster.gateway_url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 1
    assert r.json()["usage"]["prompt_tokens"] == 3000
