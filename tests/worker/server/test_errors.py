"""Bad requests get the right 4xx with an OpenAI-style body, and the worker keeps serving."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from PIL import Image

from tests.support.worker_harness import WorkerProcess

MAX_LEN = 128


@pytest.fixture(scope="module")
def worker(demo_model_dir):
    args = ("--max-model-len", str(MAX_LEN), "--data-parallel-rank", "1")
    with WorkerProcess(demo_model_dir, *args, events=False) as w:
        yield w


def _png(size: tuple[int, int]) -> str:
    buf = io.BytesIO()
    Image.new("L", size, 7).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_chat(url: str) -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    return {
        "model": "demo",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}],
    }


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
CASES = [
    ("malformed json", "/v1/chat/completions", b'{"model": "demo", "messages": [', 400),
    ("not an object", "/v1/completions", b"[1, 2, 3]", 400),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404),
    ("unknown model completions", "/v1/completions", {"model": "x", "prompt": "a"}, 404),
    ("messages wrong type", "/v1/chat/completions", {**CHAT, "messages": "hello"}, 400),
    ("messages missing", "/v1/chat/completions", {"model": "demo"}, 400),
    ("max_tokens wrong type", "/v1/chat/completions", {**CHAT, "max_tokens": "many"}, 400),
    ("negative temperature", "/v1/chat/completions", {**CHAT, "temperature": -1}, 400),
    ("n zero", "/v1/completions", {"model": "demo", "prompt": "a", "n": 0}, 400),
    ("prompt wrong type", "/v1/completions", {"model": "demo", "prompt": {"a": 1}}, 400),
    ("token id out of vocab", "/v1/completions", {"model": "demo", "prompt": [10**9]}, 400),
    ("batched prompts", "/v1/completions", {"model": "demo", "prompt": ["a", "b"]}, 400),
    ("undecodable image", "/v1/chat/completions", _image_chat("data:image/png;base64,AAAA"), 400),
    ("too many pixels", "/v1/chat/completions", _image_chat(_png((5000, 4000))), 413),
    (
        "bad content part",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "audio", "x": 1}]}]},
        400,
    ),
    (
        "prompt over max-model-len",
        "/v1/completions",
        {"model": "demo", "prompt": list(range(10, 10 + MAX_LEN + 5))},
        400,
    ),
    (
        "chat over max-model-len",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "word " * 400}]},
        400,
    ),
    (
        "max_tokens over context",
        "/v1/completions",
        {"model": "demo", "prompt": "hello", "max_tokens": MAX_LEN},
        400,
    ),
    ("logprobs unsupported", "/v1/chat/completions", {**CHAT, "logprobs": True}, 400),
]


@pytest.mark.parametrize(("name", "path", "body", "status"), CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error_and_worker_keeps_serving(worker, name, path, body, status):
    if isinstance(body, bytes):
        r = httpx.post(
            worker.url + path,
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
    else:
        r = httpx.post(worker.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    ok = httpx.post(worker.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert ok.status_code == 200
    assert httpx.get(worker.url + "/health").status_code == 200


def test_over_length_message_names_the_limit(worker):
    r = httpx.post(
        worker.url + "/v1/completions",
        json={"model": "demo", "prompt": list(range(10, 10 + MAX_LEN + 5))},
    )
    assert str(MAX_LEN) in r.json()["error"]["message"]


def test_data_parallel_rank_header(worker):
    """As vLLM reads it, the header is an index among the server's engines: this worker runs one
    engine (rank 1), so 0 names it and 1 is out of range."""
    ok = httpx.post(
        worker.url + "/v1/chat/completions", json=CHAT, headers={"X-data-parallel-rank": "0"}
    )
    assert ok.status_code == 200
    for bad in ("1", "-1", "two"):
        r = httpx.post(
            worker.url + "/v1/chat/completions", json=CHAT, headers={"X-data-parallel-rank": bad}
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert "rank" in err["message"]
        # A header's bad value is named as the gateway names x-kvgate-routing-policy's.
        assert (err["code"], err["param"]) == ("invalid_value", "x-data-parallel-rank")


def test_tokenize_without_a_prompt_names_the_missing_field(worker):
    r = httpx.post(worker.url + "/tokenize", json={}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("missing_required_parameter", "prompt"), err


@pytest.fixture(scope="module")
def small_cache(demo_model_dir):
    """4 blocks of 16: 64 tokens of KV cache, far under the demo model's 4,096-token context."""
    with WorkerProcess(demo_model_dir, "--num-blocks", "4", events=False) as w:
        yield w


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": list(range(10, 90))}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 80}]},
         "messages"),
        ("/v1/embeddings", {"input": list(range(10, 90))}, "input"),
    ],
)  # fmt: skip
def test_a_prompt_past_the_kv_cache_names_its_own_field(small_cache, path, body, param):
    """The context takes the prompt, the KV cache does not: the engine refuses it, naming the
    field it came from whichever endpoint it came to."""
    r = httpx.post(small_cache.url + path, json={"model": "demo", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", param), err
    assert "the KV cache holds at most 64 tokens" in err["message"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_is_read_as_json_whatever_its_content_type(worker, content_type) -> None:
    """As the gateway reads it: not refused as "must be a JSON object" for a missing header."""
    headers = {} if content_type is None else {"content-type": content_type}
    raw = b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    r = httpx.post(worker.url + "/v1/chat/completions", content=raw, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    bad = httpx.post(worker.url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json", bad.text


# ---- fields the worker takes but does not honour --------------------------------------------
# Each is a 400 naming the field, so a client that asked for JSON output or a tool call is not
# handed free text with a 200; the neutral values clients send unasked still pass.

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
PROMPT = {"model": "demo", "prompt": "hello", "max_tokens": 2}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
UNHONOURED = [
    (CHAT_PATH, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT_PATH, {"response_format": SCHEMA}, "response_format"),
    (COMPLETIONS_PATH, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT_PATH, {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    (CHAT_PATH, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    (CHAT_PATH, {"logit_bias": {"5": 100}}, "logit_bias"),
    (COMPLETIONS_PATH, {"logit_bias": {"5": -100}}, "logit_bias"),
    (COMPLETIONS_PATH, {"echo": True}, "echo"),
    (CHAT_PATH, {"echo": True}, "echo"),
    (COMPLETIONS_PATH, {"best_of": 3}, "best_of"),
    (COMPLETIONS_PATH, {"n": 2, "best_of": 3}, "best_of"),
    (COMPLETIONS_PATH, {"suffix": " world"}, "suffix"),
    (CHAT_PATH, {"top_logprobs": 21}, "top_logprobs"),
    (CHAT_PATH, {"top_logprobs": 5}, "top_logprobs"),
    (CHAT_PATH, {"presence_penalty": 0.5}, "presence_penalty"),
    (COMPLETIONS_PATH, {"frequency_penalty": -1}, "frequency_penalty"),
]  # fmt: skip
NEUTRAL = [
    (CHAT_PATH, {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                 "top_logprobs": 0, "logprobs": False, "echo": False,
                 "response_format": {"type": "text"}}),
    (CHAT_PATH, dict.fromkeys(("presence_penalty", "frequency_penalty", "logit_bias",
                               "top_logprobs", "echo", "response_format", "tool_choice"))),
    (CHAT_PATH, {"tools": TOOLS, "tool_choice": "auto"}),
    (CHAT_PATH, {"tools": TOOLS, "tool_choice": "none"}),
    (COMPLETIONS_PATH, {"best_of": 1, "echo": False, "suffix": "", "logit_bias": {},
                        "presence_penalty": 0, "frequency_penalty": 0, "logprobs": 0}),
    (COMPLETIONS_PATH, {"n": 2, "best_of": 2}),
]  # fmt: skip


def _base(path: str) -> dict:
    return CHAT if path == CHAT_PATH else PROMPT


@pytest.mark.parametrize(("path", "fields", "param"), UNHONOURED, ids=lambda v: str(v)[:40])
def test_a_field_the_worker_does_not_honour_is_refused(worker, path, fields, param) -> None:
    r = httpx.post(worker.url + path, json={**_base(path), **fields}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_value", param), err
    assert "not supported by this worker" in err["message"]


@pytest.mark.parametrize(("path", "fields"), NEUTRAL, ids=lambda v: str(v)[:40])
def test_the_neutral_value_of_each_is_accepted(worker, path, fields) -> None:
    r = httpx.post(worker.url + path, json={**_base(path), **fields}, timeout=30)
    assert r.status_code == 200, r.text


def test_the_openai_sdk_sees_the_refusal(worker) -> None:
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="demo", messages=CHAT["messages"], response_format={"type": "json_object"}
        )
    assert (refused.value.code, refused.value.param) == ("invalid_value", "response_format")


@pytest.fixture(scope="module")
def strict_images(demo_model_dir):
    """A worker whose image limits are below the defaults (--max-images-per-request and
    --max-image-pixels, the gateway's flags of the same names)."""
    args = ("--max-images-per-request", "1", "--max-image-pixels", "32x32")
    with WorkerProcess(demo_model_dir, *args, events=False) as w:
        yield w


def test_the_workers_image_limits_are_its_flags(strict_images) -> None:
    url = strict_images.url + "/v1/chat/completions"
    assert httpx.post(url, json=_image_chat(_png((20, 20))), timeout=30).status_code == 200
    big = httpx.post(url, json=_image_chat(_png((40, 30))), timeout=30)
    assert big.status_code == 413 and big.json()["error"]["code"] == "image_too_large", big.text
    assert "over the limit of 1024" in big.json()["error"]["message"]
    two = _image_chat(_png((20, 20)))
    two["messages"][0]["content"].insert(0, two["messages"][0]["content"][0])
    r = httpx.post(url, json=two, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "limit_exceeded", r.text
    assert "2 > limit 1" in r.json()["error"]["message"]
