"""/v1/embeddings and return_hidden_states over real HTTP: a worker with prefix caching answers
what a worker without it answers (1e-4), in the compact encodings, and bad input gets a 4xx; a
LoRA adapter named in `model` changes the embeddings and keys its own blocks and events."""

from __future__ import annotations

import base64
import json
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import zmq

from cachekey.events import BlockStored, decode_batch, parse_replay_reply, seq_bytes
from cachekey.keys import HashNamespace, block_keys
from tests.support.engine import png_bytes
from tests.support.worker_harness import WorkerProcess
from worker.demo.lora import DEMO_ADAPTERS, lora_modules_arg, write_demo_adapter

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
def lora_worker(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A torch worker with the hidden-state cache and both demo adapters in device slots."""
    root = tmp_path_factory.mktemp("embed-lora")
    adapters = {name: write_demo_adapter(root / name, name) for name in DEMO_ADAPTERS}
    args = ("--hidden-state-cache", "--max-loras", "2")
    args += ("--lora-modules", lora_modules_arg(adapters))
    with WorkerProcess(demo_model_dir, *args, *FLOAT32, engine="torch") as w:
        yield w


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
    assert r.json()["error"]["code"] == "invalid_value"


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


def _differ(a: np.ndarray, b: np.ndarray) -> bool:
    return float(np.max(np.abs(a - b))) > 1e-2 * float(np.max(np.abs(a)))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_adapter_embeddings_use_its_weights_and_hit_only_its_own_blocks(
    lora_worker, pooling: str
) -> None:
    client = httpx.Client(base_url=lora_worker.url, timeout=120)

    def one(model: str, text: str) -> tuple[np.ndarray, int, dict]:
        payload = embed(client, model=model, input=text, pooling=pooling, normalize=False)
        assert payload["model"] == model
        return vectors(payload)[0], cached(payload), payload

    text = f"Adapters, {pooling} pooling. " + TEXT  # no prefix shared with other requests
    base, base_hit, _ = one("demo", text)
    alpha, alpha_hit, payload = one("alpha", text)  # the base model's blocks are no hit
    beta, beta_hit, _ = one("beta", text)  # nor alpha's
    again, again_hit, _ = one("alpha", text)
    assert base_hit == alpha_hit == beta_hit == 0
    p = payload["usage"]["prompt_tokens"]
    assert again_hit == ((p - 1) // 16) * 16  # its own blocks (and hidden states, for mean)
    np.testing.assert_allclose(again, alpha, atol=1e-4, rtol=1e-4)
    assert _differ(alpha, base) and _differ(beta, base) and _differ(alpha, beta)

    # The other way round: the adapter's blocks are no hit for the base model.
    text = f"The base model after an adapter, {pooling} pooling. " + TEXT
    one("alpha", text)
    _, hit, payload = one("demo", text)
    assert hit == 0
    p = payload["usage"]["prompt_tokens"]
    assert one("demo", text)[1] == ((p - 1) // 16) * 16  # its own blocks, once it has them

    r = client.post("/v1/embeddings", json={"model": "gamma", "input": text})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["message"] == (
        "The model `gamma` does not exist; this worker serves `demo`, `alpha`, `beta`."
    )


def test_adapter_embedding_blocks_and_events_carry_its_name(lora_worker) -> None:
    client = httpx.Client(base_url=lora_worker.url, timeout=120)
    ids = list(range(300, 349))  # 3 full blocks and 1 token
    first = embed(client, model="alpha", input=ids)
    base = embed(client, model="demo", input=ids)
    # A repeat computes only the last token (a decode-shaped step), with the adapter too.
    again = embed(client, model="alpha", input=ids)
    assert (cached(first), cached(base), cached(again)) == (0, 0, 48)
    np.testing.assert_allclose(vectors(again)[0], vectors(first)[0], atol=1e-4, rtol=1e-4)
    assert _differ(vectors(first)[0], vectors(base)[0])
    parts = client.get("/kvgate/info").json()["fingerprint_parts"]
    ns = HashNamespace(parts["namespace_model"], parts["block_size"], parts["hash_seed"])
    want = {name: block_keys(ids, ns, (), name) for name in ("alpha", None)}
    blocks = {b["key"]: b for b in client.get("/kv/snapshot").json()["blocks"]}
    for name, keys in want.items():
        for key in keys:
            assert key.hex() in blocks, name
            assert blocks[key.hex()]["extra_keys"] == ([name] if name else [])

    def stored() -> dict[bytes, str | None]:
        return {h: ev.lora_name for ev in _replayed(lora_worker) for h in ev.block_hashes}

    deadline = time.monotonic() + 10
    while not all(k in stored() for keys in want.values() for k in keys):
        assert time.monotonic() < deadline, "the blocks' BlockStored events never came"
        time.sleep(0.1)
    events = stored()
    assert all(events[k] == "alpha" for k in want["alpha"])
    assert all(events[k] is None for k in want[None])


def _replayed(worker: WorkerProcess) -> list[BlockStored]:
    """Every BlockStored event the worker published, replayed from seq 0."""
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{worker.replay_port}")
        dealer.send_multipart([b"", seq_bytes(0)])
        out = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            item = parse_replay_reply(dealer.recv_multipart())
            if item is None:
                return out
            out += [ev for ev in decode_batch(item[1]).events if isinstance(ev, BlockStored)]
    finally:
        ctx.destroy(linger=0)
