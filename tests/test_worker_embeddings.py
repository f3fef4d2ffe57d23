"""/v1/embeddings and return_hidden_states over real HTTP: a worker with prefix caching answers
what a worker without it answers (1e-4), in the compact encodings, and bad input gets a 4xx."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_engine_utils import png_bytes
from worker_harness import WorkerProcess

TEXT = "The quick brown fox jumps over the lazy dog while the cat watches. " * 5
FLOAT32 = ("--dtype", "float32", "--device", "cpu", "--num-blocks", "256")


@pytest.fixture(scope="module")
def hot(demo_model_dir: Path):
    with WorkerProcess(demo_model_dir, "--hidden-state-cache", *FLOAT32, engine="torch") as w:
        yield httpx.Client(base_url=w.url, timeout=120)


@pytest.fixture(scope="module")
def cold(demo_model_dir: Path):
    args = ("--hidden-state-cache", "--no-prefix-caching", *FLOAT32)
    with WorkerProcess(demo_model_dir, *args, engine="torch") as w:
        yield httpx.Client(base_url=w.url, timeout=120)


@pytest.fixture(scope="module")
def matryoshka_sim(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A sim worker (no hidden-state cache) of a model that declares Matryoshka dimensions."""
    path = tmp_path_factory.mktemp("matryoshka")
    shutil.copytree(demo_model_dir, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config["matryoshka_dimensions"] = [32, 64]
    (path / "config.json").write_text(json.dumps(config))
    with WorkerProcess(path, engine="sim") as w:
        yield httpx.Client(base_url=w.url, timeout=60)


def embed(client: httpx.Client, **body) -> dict:
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def vectors(payload: dict) -> list[np.ndarray]:
    out = []
    for i, item in enumerate(payload["data"]):
        assert item["object"] == "embedding" and item["index"] == i
        e = item["embedding"]
        out.append(np.frombuffer(base64.b64decode(e), "<f4") if isinstance(e, str) else np.array(e))
    return out


def decode_hidden(choice: dict) -> np.ndarray:
    h = choice["hidden_states"]
    assert h["dtype"] == "float32" and isinstance(h["data"], str)
    return np.frombuffer(base64.b64decode(h["data"]), "<f4").reshape(h["shape"])


def cached(payload: dict) -> int:
    return payload["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_with_and_without_prefix_caching(hot, cold, pooling: str) -> None:
    inputs = [TEXT + f"Question {pooling} one?", TEXT + f"Question {pooling} two, longer?"]
    body = {"input": inputs, "pooling": pooling, "normalize": False}
    embed(hot, input=TEXT + "Warm the cache.")
    got, want = embed(hot, **body), embed(cold, **body)
    assert cached(got) > 0 and cached(want) == 0
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    for a, b in zip(vectors(got), vectors(want), strict=True):
        assert a.shape == (128,)
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_base64_normalized_and_token_ids(hot) -> None:
    ids = list(range(100, 140))
    as_float = embed(hot, input=ids)
    as_b64 = embed(hot, input=[ids], encoding_format="base64")
    (a,), (b,) = vectors(as_float), vectors(as_b64)
    assert b.dtype == np.float32
    np.testing.assert_allclose(a, b, atol=1e-6)
    assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-5
    assert as_b64["usage"]["prompt_tokens"] == as_b64["usage"]["total_tokens"] == 40
    assert cached(as_b64) == 32  # the repeat hits every full block but the last token's


def test_image_embeddings_equal(hot, cold) -> None:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(seed=7)).decode()

    def messages(question: str) -> list[dict]:
        content = [
            {"type": "text", "text": "Look at this picture carefully."},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Consider every part of the picture, then say: " + question},
        ]
        return [{"role": "user", "content": content}]

    embed(hot, messages=messages("What is it?"), pooling="mean")
    body = {"messages": messages("What colour is it?"), "pooling": "mean", "normalize": False}
    got, want = embed(hot, **body), embed(cold, **body)
    assert cached(got) >= 64  # the image span is inside the hit
    np.testing.assert_allclose(vectors(got)[0], vectors(want)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_return_hidden_states(hot, cold, endpoint: str, stream: bool) -> None:
    if endpoint == "/v1/completions":
        body: dict = {"prompt": TEXT + "Go on."}
    else:
        body = {"messages": [{"role": "user", "content": TEXT + "Go on."}]}
    body |= {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_hidden_states": True}
    body |= {"stream": stream, "n": 2, "stream_options": {"include_usage": True}}
    hot.post(endpoint, json={**body, "stream": False, "return_hidden_states": False})  # warm
    got, want = (_hidden_choices(c, endpoint, body) for c in (hot, cold))
    (prompt_tokens, hit), (_, cold_hit) = got[1], want[1]
    assert hit > 0 and cold_hit == 0
    for index in (0, 1):
        a, b = got[0][index], want[0][index]
        assert a.shape == (1, prompt_tokens + 3, 128)  # the final row, every token that ran
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def _hidden_choices(client: httpx.Client, endpoint: str, body: dict):
    r = client.post(endpoint, json=body)
    assert r.status_code == 200, r.text
    if not body["stream"]:
        payload = r.json()
        choices = {c["index"]: decode_hidden(c) for c in payload["choices"]}
        assert all(c["hidden_states"]["layers"] == [2] for c in payload["choices"])
        usage = payload["usage"]
    else:
        choices, usage = {}, None
        for line in r.text.splitlines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                if "hidden_states" in c:
                    assert c["finish_reason"] is not None  # only on the finishing chunk
                    choices[c["index"]] = decode_hidden(c)
            usage = chunk.get("usage") or usage
    return choices, (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])


def test_dimensions_on_a_matryoshka_model(matryoshka_sim) -> None:
    (v,) = vectors(embed(matryoshka_sim, input="hello there", dimensions=32))
    assert v.shape == (32,) and abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
    r = matryoshka_sim.post("/v1/embeddings", json={"input": "hello", "dimensions": 48})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


BAD = [
    ({"input": "x", "dimensions": 8}, 400, "dimensions"),
    ({"input": "x", "stream": True}, 400, "stream"),
    ({"input": "x", "messages": [{"role": "user", "content": "y"}]}, 400, None),
    ({}, 400, None),
    ({"input": []}, 400, None),
    ({"input": ["ok", ""]}, 400, None),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "pooling": "max"}, 400, "pooling"),
    ({"input": [[5, 6], [-1]]}, 400, "input"),
    ({"input": "x", "model": "other"}, 404, "model"),
    ({"input": "word " * 5000}, 400, "input"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_input_gets_a_4xx(hot, body: dict, status: int, param: str | None) -> None:
    r = hot.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param


def test_refused_without_the_hidden_state_cache(matryoshka_sim) -> None:
    r = matryoshka_sim.post("/v1/embeddings", json={"input": "x", "pooling": "mean"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "hidden_state_cache_disabled"
    body = {"prompt": "x", "max_tokens": 2, "return_hidden_states": True}
    r = matryoshka_sim.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states"
    # last-token pooling needs no cache; peer routers' explicit `false` is fine everywhere
    assert len(vectors(embed(matryoshka_sim, input="x"))[0]) == 128
    body["return_hidden_states"] = False
    assert matryoshka_sim.post("/v1/completions", json=body).status_code == 200


def test_metrics(hot) -> None:
    text = hot.get("/metrics").text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvgate_worker_hidden_state")
    }
    assert values["kvgate_worker_hidden_state_cache_bytes"] == 257 * 16 * 128 * 4
    assert values["kvgate_worker_hidden_state_hits_total"] > 0
    assert (
        values["kvgate_worker_hidden_state_queries_total"]
        > values["kvgate_worker_hidden_state_hits_total"]
    )
