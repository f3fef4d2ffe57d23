"""Input limits end to end: a real gateway (tight limits) in front of a real sim worker.

Each request past a limit gets the right status and an OpenAI error body naming the limit and
its flag; the gateway keeps serving afterwards. Also: image URLs refused by the SSRF guard and
`--no-remote-images` through the whole request path.
"""

from __future__ import annotations

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.workload import data_url, make_image
from tests.support.chat import chat, image_message, post, user
from tests.support.images import noise_png

LIMIT_ARGS = (
    "--poll-interval", "0.2",
    "--max-body-bytes", "100000",
    "--max-messages", "4",
    "--max-content-parts", "3",
    "--max-images-per-request", "2",
    "--max-image-bytes", "4000",
    "--max-image-pixels", "5000",
    "--max-prompt-tokens", "300",
    "--max-output-tokens", "64",
    "--max-n", "2",
)  # fmt: skip


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=256,
        gateway_args=LIMIT_ARGS,
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        yield c.gateway_url


def _assert_limit(r: httpx.Response, status: int, *needles: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    for n in needles:
        assert n in err["message"], err["message"]


HELLO = user("hello")


def test_within_limits_ok(gw: str) -> None:
    r = chat(gw, [image_message(data_url(make_image(3)))], n=2)
    assert r.status_code == 200, r.text


def test_body_bytes_by_content_length(gw: str) -> None:
    r = chat(gw, user("x" * 120_000))
    _assert_limit(r, 413, "request body bytes", "> limit 100000", "--max-body-bytes")


def test_body_bytes_while_reading_chunked(gw: str) -> None:
    def chunks():
        yield b'{"model": "demo", "messages": [{"role": "user", "content": "'
        for _ in range(30):
            yield b"y" * 5000
        yield b'"}]}'

    r = httpx.post(
        f"{gw}/v1/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert "content-length" not in r.request.headers  # really streamed without a length
    _assert_limit(r, 413, "request body bytes", "--max-body-bytes")


def test_messages_per_request(gw: str) -> None:
    r = chat(gw, HELLO * 5)
    _assert_limit(r, 400, "messages per request: 5 > limit 4", "--max-messages")


def test_content_parts_per_message(gw: str) -> None:
    parts = [{"type": "text", "text": "a"}] * 4
    r = chat(gw, user(parts))
    _assert_limit(r, 400, "content parts per message: 4 > limit 3", "--max-content-parts")
    assert r.json()["error"]["param"] == "messages[0].content"


def test_images_per_request(gw: str) -> None:
    url = data_url(make_image(3))
    r = chat(gw, [image_message(url, url), image_message(url)])
    _assert_limit(r, 400, "images per request: 3 > limit 2", "--max-images-per-request")


def test_image_bytes(gw: str) -> None:
    png = noise_png(5, 64)
    assert len(png) > 4000
    r = chat(gw, [image_message(data_url(png))])
    _assert_limit(r, 413, "4000", "--max-image-bytes")


def test_image_pixels(gw: str) -> None:
    png = make_image(4, size=100)  # 10,000 pixels, few bytes
    assert len(png) < 4000
    r = chat(gw, [image_message(data_url(png))])
    _assert_limit(r, 413, "pixels", "5000", "--max-image-pixels")


def test_prompt_tokens(gw: str) -> None:
    r = chat(gw, user("word " * 600))
    _assert_limit(r, 400, "300", "--max-prompt-tokens")
    r = post(gw, {"model": "demo", "prompt": "word " * 600, "max_tokens": 2}, "/v1/completions")
    _assert_limit(r, 400, "300", "--max-prompt-tokens")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_output_tokens(gw: str, field: str) -> None:
    body = {"model": "demo", "messages": HELLO, field: 65}
    _assert_limit(post(gw, body), 400, f"{field}: 65 > limit 64", "--max-output-tokens")


def test_n(gw: str) -> None:
    _assert_limit(chat(gw, HELLO, n=3), 400, "n: 3 > limit 2", "--max-n")


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1/cat.png",
        "http://169.254.169.254/latest/meta-data",
        "http://localhost:9/cat.png",
        "http://[::ffff:0:a9fe:a9fe]/latest/meta-data",  # SIIT form of the metadata address
    ],
)
def test_ssrf_refused_through_the_gateway(gw: str, url: str) -> None:
    r = chat(gw, [image_message(url)])
    _assert_limit(r, 400, "is not allowed", "--image-fetch-allow")
    message = r.json()["error"]["message"]
    assert "127.0.0.1" not in message  # what localhost resolved to stays on the gateway


def test_gateway_keeps_serving_after_violations(gw: str) -> None:
    for _ in range(3):
        assert chat(gw, HELLO * 9).status_code == 400
    r = chat(gw, HELLO)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{gw}/health").status_code == 200


def test_no_remote_images_flag(tmp_path) -> None:
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=64,
        gateway_args=("--no-remote-images",),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        r = chat(c.gateway_url, [image_message("https://example.com/cat.png")])
        _assert_limit(r, 400, "--no-remote-images")
        ok = chat(c.gateway_url, [image_message(data_url(make_image(5)))])
        assert ok.status_code == 200, ok.text
