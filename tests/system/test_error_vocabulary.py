"""One error vocabulary: the gateway and a worker, each asked directly over real HTTP, refuse the
same condition with the same status, `code` and `param` (and, where both word it, the same
message). The table of them is docs/gateway.md's *Errors*."""

from __future__ import annotations

import io
import json

import httpx
import pytest
from PIL import Image

from harness.cluster import Cluster, ClusterSpec
from harness.workload import data_url
from tests.support.chat import chat_body, user

CHAT, EMBED = "/v1/chat/completions", "/v1/embeddings"
LIMITS = ("--max-body-bytes", "64KiB")
POLICIES = ("cache_aware", "round_robin", "least_loaded", "session", "random")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        worker_args=LIMITS,
        gateway_args=("--poll-interval", "0.2", *LIMITS),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        yield c


def both(c: Cluster, path: str, body, method: str = "POST") -> tuple[httpx.Response, ...]:
    """The same request to the gateway and to the worker."""
    kw: dict = {"json": body}
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    if method == "GET":
        kw = {}
    return tuple(
        httpx.request(method, f"{url}{path}", timeout=30, **kw)
        for url in (c.gateway_url, c.worker_urls[0])
    )


def error(r: httpx.Response) -> tuple[int, str, str | None, str]:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return r.status_code, err["code"], err["param"], err["message"]


TOO_LONG = "hi " * 5000  # 10,000 tokens; the demo model's context is 4,096


def _body(content: str | list[dict], **kw) -> dict:
    return chat_body(user(content), **kw)


BAD_IMAGE = data_url(b"not a png")
HI = json.dumps(_body("hi", max_tokens=2))


def _png(size: tuple[int, int], mode: str = "1") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


def _images(*pngs: bytes) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(png)}} for png in pngs]
    return _body([{"type": "text", "text": "look"}, *parts])


# 196M pixels, past Pillow's own cap (2 x MAX_IMAGE_PIXELS); 24 KB as a PNG of one colour.
PAST_PILLOW_CAP = _png((14_000, 14_000))


# What a message says, in words a client can act on rather than a parser's or Pillow's.
SAYS = {
    "an empty body": "invalid JSON body: the body is empty",
    "UTF-16 without a byte-order mark": "JSON is UTF-8",
    "NaN": "NaN and Infinity are not JSON numbers",
    "Infinity": "NaN and Infinity are not JSON numbers",
    "a lone surrogate": "a string holds a lone UTF-16 surrogate",
    "33 images": "images per request: 33 > limit 32",
    "an image past Pillow's cap": "image is 196000000 pixels, over the limit of 16777216",
    "an empty image URL": "image_url.url must be a non-empty string",
}


@pytest.mark.parametrize(
    ("what", "path", "body", "status", "code", "param", "same_message"),
    [
        ("temperature -1", CHAT, _body("hi", temperature=-1), 400,
         "decimal_below_min_value", "temperature", True),
        ("n as a string", CHAT, _body("hi", n="2"), 400, "invalid_type", "n", True),
        ("messages missing", CHAT, {"model": "demo"}, 400,
         "missing_required_parameter", "messages", True),
        ("not JSON", CHAT, b'{"model": "demo", "messages": [', 400, "invalid_json", None, True),
        ("an empty body", CHAT, b"", 400, "invalid_json", None, True),
        ("UTF-16", CHAT, HI.encode("utf-16"), 400, "invalid_json", None, True),
        ("UTF-16 without a byte-order mark", CHAT, HI.encode("utf-16-le"), 400, "invalid_json",
         None, True),
        ("NaN", CHAT, HI.replace('"hi"', '"hi", "temperature": NaN').encode(), 400,
         "invalid_json", None, True),
        ("Infinity", CHAT, HI.replace('"hi"', '"hi", "top_p": -Infinity').encode(), 400,
         "invalid_json", None, True),
        ("a lone surrogate", CHAT, HI.replace('"hi"', '"\\ud800"').encode(), 400,
         "invalid_json", None, True),
        ("body over --max-body-bytes", CHAT, json.dumps(_body("x" * 70_000)).encode(), 413,
         "limit_exceeded", "body", True),
        ("prompt over the context", CHAT, _body(TOO_LONG), 400,
         "context_length_exceeded", "messages", False),
        ("embeddings input over the context", EMBED, {"model": "demo", "input": TOO_LONG}, 400,
         "context_length_exceeded", "input", False),
        ("not an image", CHAT, _body([{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": BAD_IMAGE}}]),
         400, "invalid_image", "messages[0].content[1]", True),
        ("unknown model", CHAT, _body("hi", model="nope"), 404, "model_not_found", "model", False),
        ("not UTF-8", CHAT, b'{"model": "demo", "messages": [{"role": "user", "content": "\xe9"}]}',
         400, "invalid_json", None, True),
        ("33 images", CHAT, _images(*[_png((8, 8))] * 33), 400, "limit_exceeded", "messages",
         False),
        ("an image past Pillow's cap", CHAT, _images(PAST_PILLOW_CAP), 413, "image_too_large",
         "messages[0].content[1]", False),
        ("an empty image URL", CHAT, _body([{"type": "image_url", "image_url": {"url": ""}}]),
         400, "unsupported_content", "messages[0].content[0]", True),
        ("a part type that is a list", CHAT, _body([{"type": ["text"]}]), 400,
         "unsupported_content", "messages[0].content[0].type", True),
        ("an empty stop string", CHAT, _body("hi", stop=""), 400, "invalid_value", None, True),
        ("an empty embeddings input", EMBED, {"model": "demo", "input": ""}, 400,
         "invalid_value", None, True),
    ],
)  # fmt: skip
def test_gateway_and_worker_refuse_alike(
    cluster, what, path, body, status, code, param, same_message
) -> None:
    gateway, worker = (error(r) for r in both(cluster, path, body))
    assert gateway[:3] == worker[:3] == (status, code, param), what
    if same_message:
        assert gateway[3] == worker[3], what
    elif code in ("context_length_exceeded", "limit_exceeded", "image_too_large"):
        assert gateway[3].startswith(worker[3]), what  # the gateway names its flag after them
    if what in SAYS:
        assert SAYS[what] in worker[3], worker[3]


def test_a_utf8_byte_order_mark_is_skipped_by_both(cluster) -> None:
    """RFC 8259 lets a parser ignore it, and vLLM's (Python's json.loads) does."""
    for r in both(cluster, CHAT, b"\xef\xbb\xbf" + HI.encode()):
        assert r.status_code == 200, r.text


def test_prompt_and_output_over_the_context(cluster) -> None:
    """The prompt fits, not with max_tokens: the worker says it with the same code (the
    gateway passes its answer on), and names the field to change."""
    for name in ("max_tokens", "max_completion_tokens"):
        for r in both(cluster, CHAT, _body("a short prompt", **{name: 4090})):
            status, code, param, message = error(r)
            assert (status, code, param) == (400, "context_length_exceeded", name)
            assert "maximum context length is 4096 tokens" in message


def test_unknown_routes_and_methods(cluster) -> None:
    for r in both(cluster, "/v1/responses", {}):
        assert error(r) == (
            404, "unknown_url", None, "Invalid URL (POST /v1/responses): no such endpoint"
        )  # fmt: skip
    for r in both(cluster, CHAT, None, method="GET"):
        assert error(r) == (
            405, "method_not_allowed", None,
            "Invalid method for URL (GET /v1/chat/completions): use POST",
        )  # fmt: skip
        assert r.headers["allow"] == "POST"


def test_unknown_policy_lists_the_valid_ones(cluster) -> None:
    r = httpx.post(
        f"{cluster.gateway_url}{CHAT}",
        json=_body("hi"),
        headers={"x-kvgate-routing-policy": "fastest"},
        timeout=30,
    )
    status, code, param, message = error(r)
    assert (status, code, param) == (400, "invalid_value", "x-kvgate-routing-policy")
    assert "'fastest'" in message and all(p in message for p in POLICIES)


def test_a_refused_image_url_names_its_content_part(cluster) -> None:
    """The SSRF guard's refusal points at the part, as every other image error does."""
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/cat.png"}}
    body = _body([{"type": "text", "text": "look"}, image])
    r = httpx.post(f"{cluster.gateway_url}{CHAT}", json=body, timeout=30)
    status, code, param, message = error(r)
    assert (status, code, param) == (400, "image_fetch_failed", "messages[0].content[1]")
    assert "not allowed" in message
