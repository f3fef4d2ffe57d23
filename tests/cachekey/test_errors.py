"""Bad requests become typed errors with a status, the blamed field and an actionable message."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

from cachekey import (
    ImageFetchError,
    ImageTooLargeError,
    InvalidImageError,
    ModelAssets,
    PromptTooLongError,
    Renderer,
    RenderError,
    RenderLimits,
    TemplateError,
    TooManyImagesError,
    UnsupportedContentError,
    decode_data_url,
    probe_image,
)


def encoded(fmt: str, size=(20, 10), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, fmt)
    return buf.getvalue()


def url_of(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def image_msg(url: str, **extra) -> list:
    part = {"type": "image_url", "image_url": {"url": url}, **extra}
    return [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]


@pytest.fixture(scope="module")
def assets(demo_model_dir: Path) -> ModelAssets:
    return ModelAssets.from_dir(demo_model_dir)


@pytest.fixture(scope="module")
def renderer(assets) -> Renderer:
    return Renderer(assets)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_probe_reads_every_supported_format(fmt):
    assert probe_image(encoded(fmt, (20, 10)))[:2] == (20, 10)


def png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims a size its empty IDAT never backs: only a header probe takes it."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [5000, 40000])  # over our limit; over Pillow's bomb limit too
def test_huge_images_are_refused_from_the_header_alone(side):
    with pytest.raises(ImageTooLargeError, match="pixels"):
        probe_image(png_header(side, side), max_pixels=4096 * 4096)
    assert probe_image(png_header(300, 200))[:2] == (300, 200)


def test_data_url_errors():
    with pytest.raises(InvalidImageError, match="base64"):
        decode_data_url("data:image/png;base64,@@not base64@@")
    with pytest.raises(InvalidImageError, match="base64-encoded"):
        decode_data_url("data:image/png,rawtext")
    with pytest.raises(InvalidImageError, match="separating"):
        decode_data_url("data:image/png;base64")
    with pytest.raises(ImageTooLargeError):
        decode_data_url("data:image/png;base64," + "A" * 4000, max_bytes=1000)
    wrapped = base64.encodebytes(b"x" * 200).decode()  # 76-column lines
    assert decode_data_url("data:image/png;base64," + wrapped) == b"x" * 200


IMG = "messages[0].content[1]"
UCE = UnsupportedContentError


@pytest.mark.parametrize(
    ("messages", "error", "status", "param", "match"),
    [
        (image_msg("data:image/png;base64,***"), InvalidImageError, 400, IMG, "base64"),
        (
            image_msg(url_of(b"plain text, not an image")),
            InvalidImageError,
            400,
            IMG,
            "not an image",
        ),
        (image_msg(url_of(encoded("PNG", (300, 300)))), ImageTooLargeError, 413, IMG, "pixels"),
        (image_msg("https://example.com/cat.png"), ImageFetchError, 422, IMG, "disabled"),
        (image_msg("ftp://example.com/cat.png"), InvalidImageError, 400, IMG, "http"),
        (image_msg(url_of(encoded("PNG")), uuid=7), UCE, 400, IMG, "uuid"),
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            UCE,
            400,
            "messages[0].content[0].type",
            "'input_audio' is not supported; use 'text', 'image_url' or 'input_image'",
        ),
        ([{"role": "wizard", "content": "hi"}], UCE, 400, "messages[0].role", "wizard"),
        ([{"role": ["user"], "content": "hi"}], UCE, 400, "messages[0].role", "role"),
        (
            [{"role": "user", "content": [{"type": {}}]}],
            UCE,
            400,
            "messages[0].content[0].type",
            "{}",
        ),
        ([{"role": "user", "content": ["text"]}], UCE, 400, "messages[0].content[0].type", "None"),
        ([{"role": "user", "content": None}], UCE, 400, "messages[0].content", "required"),
        ([{"role": "user", "content": 5}], UCE, 400, "messages[0].content", "string"),
        (["not a message"], UCE, 400, "messages[0]", "object"),
        ([], UCE, 400, "messages", "non-empty"),
        (
            [{"role": "user", "content": "a literal <image> in text"}],
            UCE,
            400,
            "messages",
            "placeholder",
        ),
        (
            [{"role": "user", "content": "word " * 5000}],
            PromptTooLongError,
            400,
            "messages",
            "maximum context length is 4096",
        ),
    ],
)
def test_chat_errors(renderer, messages, error, status, param, match):
    renderer = Renderer(renderer.assets, limits=RenderLimits(max_image_pixels=256 * 256))
    with pytest.raises(error, match=match) as info:
        renderer.render_chat(messages)
    assert info.value.status_code == status and info.value.param == param
    body = info.value.to_dict()["error"]
    assert body["message"] and body["param"] == param and body["type"] == "invalid_request_error"


def test_limits_lower_the_context_and_cap_images(assets):
    small = Renderer(assets, limits=RenderLimits(max_model_len=32, max_images=1))
    with pytest.raises(PromptTooLongError, match="32 tokens"):
        small.render_completion("word " * 40)
    raw = encoded("PNG")
    two = image_msg(url_of(raw))
    two[0]["content"].append({"type": "image_url", "image_url": {"url": url_of(raw)}})
    with pytest.raises(TooManyImagesError, match="images per request: 2 > limit 1") as info:
        small.render_chat(two)
    assert (info.value.status_code, info.value.code, info.value.param) == (
        400, "limit_exceeded", "messages"
    )  # fmt: skip


def test_fetcher_failures_are_fetch_errors(assets):
    def broken(url: str) -> bytes:
        raise ConnectionError("connection refused")

    def refusing(url: str) -> bytes:
        raise ImageFetchError("host not allowed", param="x")

    msgs = image_msg("http://10.0.0.1/a.png")
    with pytest.raises(ImageFetchError, match="connection refused"):
        Renderer(assets, fetcher=broken).render_chat(msgs)
    with pytest.raises(ImageFetchError, match="host not allowed"):
        Renderer(assets, fetcher=refusing).render_chat(msgs)


def test_completion_errors(renderer):
    with pytest.raises(UnsupportedContentError, match="not a token id"):
        renderer.render_completion([1, 2, 999_999])
    with pytest.raises(UnsupportedContentError, match="not a token id"):
        renderer.render_completion([1, True])
    with pytest.raises(UnsupportedContentError, match="empty"):
        renderer.render_completion([])
    with pytest.raises(UnsupportedContentError, match="placeholder"):
        renderer.render_completion("an <image> in a completion")
    with pytest.raises(UnsupportedContentError, match="string or a list"):
        renderer.render_completion({"text": "x"})  # type: ignore[arg-type]
    with pytest.raises(PromptTooLongError):
        renderer.render_completion([5] * 4097)


def test_template_errors_and_reserved_kwargs(assets):
    bad = ModelAssets.from_files(
        {
            **assets.files,
            "chat_template.jinja": b"{% if messages[0]['role'] != 'user' %}"
            b"{{ raise_exception('first message must be from the user') }}{% endif %}ok",
        }
    )
    r = Renderer(bad)
    with pytest.raises(TemplateError, match="first message must be from the user") as info:
        r.render_chat([{"role": "system", "content": "x"}])
    assert info.value.status_code == 400
    assert r.render_chat([{"role": "user", "content": "x"}]).token_ids
    with pytest.raises(UnsupportedContentError, match="chat_template_kwargs"):
        Renderer(assets).render_chat(
            [{"role": "user", "content": "x"}], chat_template_kwargs={"messages": []}
        )


def test_text_only_model_refuses_images(assets):
    files = {k: v for k, v in assets.files.items() if k != "config.json"}
    text_only = Renderer(ModelAssets.from_files(files))
    with pytest.raises(UnsupportedContentError, match="does not accept images"):
        text_only.render_chat(image_msg(url_of(encoded("PNG"))))
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    p = text_only.render_chat([{"role": "user", "content": parts}])
    assert "a\nb" in text_only.decode(p.token_ids)


def test_every_error_is_a_value_error_with_a_status():
    for cls in (InvalidImageError, ImageTooLargeError, UnsupportedContentError, PromptTooLongError):
        err = cls("m", param="p")
        assert isinstance(err, RenderError) and isinstance(err, ValueError)
        assert err.status_code in (400, 413, 422)
