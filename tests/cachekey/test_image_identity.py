"""Image identity a client cannot forge (issue 14, finding 3), at the renderer.

The end-to-end attack (a poisoned cache on a real worker) is in tests/gateway/test_images.py; here:
what each uuid mode makes of a client's uuid, over the real renderer and demo assets.
"""

from __future__ import annotations

import base64
import re

import pytest

from cachekey import (
    IGNORE_UUIDS,
    ClientUuids,
    ImageOptions,
    ModelAssets,
    Renderer,
    image_identifier,
    scoped_uuid_identifier,
)
from gateway.images.fetch import RemoteImagesDisabled, image_options
from harness.workload import make_image

CONTENT_HASH = re.compile(r"[0-9a-f]{32}")


def test_scoped_identifier_names_its_scope_and_is_never_a_content_hash() -> None:
    a = scoped_uuid_identifier("team-a", "logo")
    assert a == scoped_uuid_identifier("team-a", "logo")  # stable: the same on every gateway
    assert a != scoped_uuid_identifier("team-b", "logo")
    assert a != scoped_uuid_identifier("", "logo")
    # Length-prefixed: moving characters between scope and uuid changes the identifier.
    assert scoped_uuid_identifier("ab", "c") != scoped_uuid_identifier("a", "bc")
    victim = image_identifier(make_image(1))
    for uuid in (victim, "uuid-" + victim, a):
        forged = scoped_uuid_identifier("team-a", uuid)
        assert forged != victim and not CONTENT_HASH.fullmatch(forged)
    assert CONTENT_HASH.fullmatch(victim)


def test_modes() -> None:
    data = make_image(2)
    assert ClientUuids().identifier("x", data) == "x"  # verbatim: the worker behind a gateway
    assert IGNORE_UUIDS.identifier("x", data) == image_identifier(data)
    assert ClientUuids("scoped", "t").identifier("x", data) == scoped_uuid_identifier("t", "x")
    assert ClientUuids("scoped", "t").identifier(None, data) == image_identifier(data)
    with pytest.raises(ValueError, match="verbatim, ignore or scoped"):
        ClientUuids("trust")


def test_gateway_options_per_tenant() -> None:
    fetcher = RemoteImagesDisabled()
    assert image_options(fetcher, False, "team-a").uuids == IGNORE_UUIDS
    assert image_options(fetcher, True, "team-a").uuids == ClientUuids("scoped", "team-a")
    assert image_options(fetcher, True, None).uuids == ClientUuids("scoped", "")


@pytest.fixture(scope="module")
def renderer(demo_model_dir) -> Renderer:
    return Renderer(ModelAssets.from_dir(demo_model_dir))


def _identifiers(renderer: Renderer, uuid: str, images: ImageOptions) -> list[str]:
    url = "data:image/png;base64," + base64.b64encode(make_image(3)).decode()
    part = {"type": "image_url", "image_url": {"url": url}, "uuid": uuid}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]
    return [i.identifier for i in renderer.render_chat(messages, images=images).mm_items]


def test_renderer_applies_the_request_options(renderer: Renderer) -> None:
    victim = image_identifier(make_image(9))
    assert _identifiers(renderer, victim, ImageOptions()) == [victim]  # verbatim (worker)
    assert _identifiers(renderer, victim, ImageOptions(uuids=IGNORE_UUIDS)) == [
        image_identifier(make_image(3))
    ]
    scoped = ImageOptions(uuids=ClientUuids("scoped", "team-a"))
    assert _identifiers(renderer, victim, scoped) == [scoped_uuid_identifier("team-a", victim)]
