"""Bodies and types as attacks on a real gateway and sim worker over HTTP (issue 14, 4 and 5).

Each test sends what the attack sent and shows it now fails cleanly: a 400 with an OpenAI error
body, the gateway's memory flat, and the gateway still serving.
"""

from __future__ import annotations

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from tests.support.chat import CHAT, post, user
from tests.support.json_bombs import many_keys, many_objects, reset_peak_rss, status_kib

pytestmark = pytest.mark.slow

ARGS = ("--poll-interval", "0.2", "--max-output-tokens", "64", "--max-n", "2")  # fmt: skip
HELLO = user("hello")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=512,
        gateway_args=ARGS,
        log_dir=tmp_path_factory.mktemp("bodies"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        yield c


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    return err


# ---- finding 4: limits passed by type ------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "got"),
    [
        ("n", "64", "a string"),
        ("n", 64.0, "a decimal number"),
        ("n", True, "a boolean"),
        ("max_tokens", "40000", "a string"),
        ("max_tokens", 40.0, "a decimal number"),
        ("max_completion_tokens", "40000", "a string"),
        ("seed", "7", "a string"),
        ("seed", 1.5, "a decimal number"),
        ("top_k", "5", "a string"),
        ("logprobs", "true", "a string"),
        ("stream", "false", "a string"),
    ],
)
def test_wrong_typed_numbers_are_refused(cluster, field: str, value, got: str) -> None:
    """`n: "64"` and `n: 64.0` gave 64 choices past --max-n 16; now they are type errors."""
    body = {"model": "demo", "messages": HELLO, "max_tokens": 2, field: value}
    err = _error(post(cluster.gateway_url, body))
    assert err["param"] == field and err["code"] == "invalid_type"
    expected = "a boolean" if field in ("logprobs", "stream") else "an integer"
    assert err["message"] == (
        f"Invalid type for '{field}': expected {expected}, but got {got} instead."
    )


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("temperature", "0.5", "a number"), ("top_p", True, "a number"), ("model", 7, "a string")],
)
def test_wrong_typed_other_fields(cluster, field: str, value, expected: str) -> None:
    err = _error(post(cluster.gateway_url, {"model": "demo", "messages": HELLO, field: value}))
    assert err["param"] == field and expected in err["message"]


def test_integers_still_work_where_numbers_belong(cluster) -> None:
    body = {"model": "demo", "messages": HELLO, "max_tokens": 2, "temperature": 1, "top_p": 1}
    assert post(cluster.gateway_url, body).status_code == 200


def test_bounds_read_like_openai(cluster) -> None:
    err = _error(post(cluster.gateway_url, {"model": "demo", "messages": HELLO, "n": 0}))
    assert err["code"] == "integer_below_min_value"
    assert err["message"] == (
        "Invalid 'n': integer below minimum value. Expected a value >= 1, but got 0 instead."
    )


def test_missing_max_tokens_gets_the_configured_default(cluster) -> None:
    """Without max_tokens the worker used to generate up to the whole context (4,083 tokens);
    now the gateway sends --max-output-tokens (64), bounded by the context left."""
    body = {"model": "demo", "messages": HELLO, "ignore_eos": True}
    r = post(cluster.gateway_url, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 64
    # A prompt that leaves fewer than 64 tokens of context gets what is left, not a 400; an
    # explicit null is "not set" too.
    context = httpx.get(f"{cluster.workers[0].url}/kvgate/info").json()["max_model_len"]
    prompt = [5] * (context - 20)
    comp = {"model": "demo", "prompt": prompt, "ignore_eos": True, "max_tokens": None}
    r = post(cluster.gateway_url, comp, "/v1/completions")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 20


def test_explicit_max_tokens_is_kept(cluster) -> None:
    body = {"model": "demo", "messages": HELLO, "ignore_eos": True, "max_tokens": 5}
    assert post(cluster.gateway_url, body).json()["usage"]["completion_tokens"] == 5
    comp = {"model": "demo", "prompt": "hello", "ignore_eos": True}  # completions: OpenAI's 16
    r = post(cluster.gateway_url, comp, "/v1/completions")
    assert r.json()["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [("top_k", 2**64, "top_k"), ("stop_token_ids", [2**64], "stop_token_ids[0]")],
)
def test_integers_past_int64_are_a_400_and_eject_nobody(cluster, field, value, param) -> None:
    """The worker hands these to its engine core as msgpack, which has no integer past 64 bits:
    `top_k: 2**64` was a 500 there, the gateway's circuit breaker counted it, and three such
    requests ejected every replica (every client got 503 for --eject-seconds)."""
    body = {"model": "demo", "messages": HELLO, "max_tokens": 2, field: value}
    for url in (cluster.workers[0].url, *[cluster.gateway_url] * 4):
        err = _error(post(url, body))
        assert err["param"] == param and err["code"] == "integer_above_max_value", err
    assert httpx.get(f"{cluster.gateway_url}/health").status_code == 200
    assert post(cluster.gateway_url, {"model": "demo", "messages": HELLO}).status_code == 200


def test_the_largest_seed_takes_several_choices(cluster) -> None:
    """Choice i samples with seed + i, wrapped within int64: the largest int64 with n 2 was a
    400 for a seed the client never sent."""
    body = {"model": "demo", "messages": HELLO, "max_tokens": 2, "n": 2, "seed": 2**63 - 1}
    r = post(cluster.gateway_url, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


# ---- finding 5: bodies and encodings -------------------------------------------------------


@pytest.mark.parametrize("depth", [65, 5_000, 100_000])
def test_deep_nesting_is_a_400(cluster, depth: int) -> None:
    """Nested 5,000 or 100,000 deep gave a plain 500 (RecursionError)."""
    junk = b"[" * depth + b"]" * depth
    body = b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "x": ' + junk + b"}"
    err = _error(post(cluster.gateway_url, body))
    assert err["code"] == "json_too_deep" and "--max-json-depth" in err["message"]


@pytest.mark.parametrize(
    "text",
    [
        b'"\\ud800"',  # a lone high surrogate, escaped
        b'"a\\udc00b"',  # a lone low surrogate
        b'"\\ud800\\ud800"',  # two highs
        b'"\xed\xa0\x80"',  # a surrogate as raw (invalid) UTF-8
        b'"\xff"',  # not UTF-8 at all
    ],
)
def test_lone_surrogates_and_bad_utf8_are_a_400(cluster, text: bytes) -> None:
    """A lone \\ud800 gave a plain 500 (TypeError in the tokenizer)."""
    body = b'{"model": "demo", "messages": [{"role": "user", "content": ' + text + b"}]}"
    err = _error(post(cluster.gateway_url, body))
    assert err["code"] == "invalid_json"


@pytest.mark.parametrize("text", [b'"\\ud800"', b'"x\\udfff"', b'"\\ud800\\ud800"'])
def test_the_worker_refuses_lone_surrogates_too(cluster, text: bytes) -> None:
    """Sent to the worker itself (a pod past the NetworkPolicy): a 400, where it was a 500."""
    body = b'{"model": "demo", "messages": [{"role": "user", "content": ' + text + b"}]}"
    err = _error(post(cluster.workers[0].url, body))
    assert "surrogate" in err["message"]


def test_surrogate_pairs_are_fine(cluster) -> None:
    emoji = b'"\\ud83d\\ude00"'  # one astral character as an escaped pair
    body = b'{"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]}'
    body %= emoji
    assert post(cluster.gateway_url, body).status_code == 200
    assert post(cluster.workers[0].url, body).status_code == 200


@pytest.mark.parametrize("make", [many_keys, many_objects])
def test_32_mib_of_elements_leaves_memory_flat(cluster, make) -> None:
    """A 32 MiB `{...}` body under the size limit took the gateway from ~80 MB to 928 MB.

    The element bound refuses it on the raw bytes; the gateway's peak RSS (VmHWM, reset before
    the request) stays within a few copies of the body.
    """
    body = make(32 * 2**20 - 1024)
    pid = cluster.gateways[0].popen.pid
    before = reset_peak_rss(pid)
    err = _error(post(cluster.gateway_url, body))
    peak = status_kib(pid, "VmHWM")
    assert err["code"] == "json_too_large" and "--max-json-elements" in err["message"]
    grew_mib = (peak - before) / 1024
    print(f"{make.__name__}: gateway RSS {before / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB")
    assert grew_mib < 128, grew_mib  # before: +850 MiB (issue 14); now about +50


def test_huge_unknown_field_is_forwarded_within_the_limits(cluster) -> None:
    body = {"model": "demo", "messages": HELLO, "max_tokens": 2, "junk": "x" * (8 * 2**20)}
    assert post(cluster.gateway_url, body).status_code == 200


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
        (CHAT, {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        (CHAT, {"presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/completions", {"suffix": " world", "best_of": 2}, "suffix"),
    ],
)
def test_a_field_only_the_worker_refuses_is_forwarded(cluster, path, fields, param) -> None:
    """The gateway also fronts vLLM servers, which honour these: it forwards them, and the
    kvgate worker's own 400 (worker/server/protocol.py) comes back as the worker sent it."""
    base = {"model": "demo", "max_tokens": 2}
    body = {**base, **({"messages": HELLO} if path == CHAT else {"prompt": "hi"}), **fields}
    direct = post(cluster.workers[0].url, body, path)
    through = post(cluster.gateway_url, body, path)
    assert _error(through)["param"] == param
    assert through.json() == direct.json()
    assert through.headers.get("x-kvgate-replica")  # answered by the worker, not the gateway


def test_gateway_still_serves(cluster) -> None:
    r = post(cluster.gateway_url, {"model": "demo", "messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert httpx.get(f"{cluster.workers[0].url}/health").status_code == 200
