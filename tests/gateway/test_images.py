"""Image attacks on a real gateway and sim worker, with a malicious image server on 127.0.0.1.

Issue 14: slow remote images with a deadline per URL (finding 2), a gzip response inflating to
200 MiB inside the gateway (finding 5), and cache poisoning through a client's image `uuid`
(finding 3). Each test makes the attack and shows that it now fails.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from cachekey import image_identifier
from harness.cluster import Cluster, ClusterSpec
from harness.workload import data_url, make_image
from tests.support.chat import chat, image_message
from tests.support.image_server import ImageServer
from tests.support.images import noise_png

pytestmark = pytest.mark.slow

SYSTEM = "You describe product photos for the catalogue team, briefly and exactly. " * 12
ARGS = (
    "--poll-interval", "0.2",
    "--image-fetch-allow", "127.0.0.1/32",
    "--image-fetch-timeout", "2",
    "--image-fetch-max-bytes", "60000",
)  # fmt: skip


@pytest.fixture(scope="module")
def srv():
    s = ImageServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("images")
    spec = ClusterSpec(
        workers=1, engine="sim", num_blocks=1024, gateway_args=ARGS, log_dir=logs,
        startup_timeout=60,
    )  # fmt: skip
    with Cluster(spec) as c:
        # A second gateway on the same worker, as an operator who allows client uuids runs it.
        g = c.make_gateway(1)
        g.args.append("--allow-image-uuids")
        c.gateways.append(g)
        g.start()
        g.wait_healthy(60)
        yield c


# Text after the image: so the image is followed by full blocks (a match is never the whole
# prompt, nor stops inside an image, so a short tail would hide the image's blocks).
AFTER = " Describe the colours, the stripes and their spacing in one short sentence." * 3


def _catalogue(*images: str, text: str = "describe", **image: str | None) -> list[dict]:
    """The catalogue's system prompt, then the images and `text` (`image`: uuid, kind)."""
    return [
        {"role": "system", "content": SYSTEM},
        image_message(*images, text=text + AFTER, **image),
    ]


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


# ---- finding 3: cache poisoning through uuid --------------------------------------------


def _poisoning_attempt(
    gw: str, seed: int, uuid_of_victim, kind: str = "image_url"
) -> tuple[int, int, int]:
    """(cached tokens of a fresh image, of the victim after the attack, of the victim again)."""
    victim, evil, fresh = (data_url(make_image(seed + i)) for i in range(3))
    text = f"attempt {seed}"
    forged = uuid_of_victim(make_image(seed))
    _cached(chat(gw, _catalogue(evil, uuid=forged, text=text, kind=kind)))  # the attack
    baseline = _cached(chat(gw, _catalogue(fresh, text=text, kind=kind)))  # shared text, new image
    after = _cached(chat(gw, _catalogue(victim, text=text, kind=kind)))
    again = _cached(chat(gw, _catalogue(victim, text=text, kind=kind)))
    return baseline, after, again


def test_uuid_naming_another_images_hash_poisons_nothing(cluster) -> None:
    """Image E sent with `uuid` = V's content hash: a later V got 80 of 85 cached tokens from E's
    KV. The gateway now ignores a client's uuid; V's identifier is its own content hash."""
    baseline, after, again = _poisoning_attempt(cluster.gateway_url, 100, image_identifier)
    assert after == baseline  # only the text before the image: nothing of E
    assert again > baseline  # V's own blocks are cached and reused


def test_input_image_parts_cannot_carry_a_forged_uuid_either(cluster) -> None:
    """`input_image` parts were not re-labelled by the gateway, so the client's uuid reached the
    worker, which takes it verbatim: the same poisoning, one hop later."""
    baseline, after, again = _poisoning_attempt(
        cluster.gateway_url, 150, image_identifier, kind="input_image"
    )
    assert after == baseline and again > baseline


def test_scoped_uuids_cannot_name_a_content_hash(cluster) -> None:
    """With --allow-image-uuids a uuid counts, but scoped: it can never equal a content hash."""
    gw = cluster.gateways[1].url
    baseline, after, again = _poisoning_attempt(gw, 200, image_identifier)
    assert after == baseline and again > baseline


def test_scoped_uuids_keep_their_meaning(cluster) -> None:
    """With --allow-image-uuids, one uuid is one image for its (one) tenant: vLLM's contract."""
    gw = cluster.gateways[1].url
    first, second = make_image(300), make_image(301)
    baseline = _cached(chat(gw, _catalogue(data_url(make_image(302)), text="logo")))
    _cached(chat(gw, _catalogue(data_url(first), uuid="logo-v1", text="logo")))
    assert _cached(chat(gw, _catalogue(data_url(second), uuid="logo-v1", text="logo"))) > baseline
    # The default gateway ignores the uuid: the same pair shares nothing past the text.
    gw0 = cluster.gateway_url
    _cached(chat(gw0, _catalogue(data_url(first), uuid="logo-v2", text="logo 0")))
    base0 = _cached(chat(gw0, _catalogue(data_url(make_image(303)), text="logo 0")))
    assert _cached(chat(gw0, _catalogue(data_url(second), uuid="logo-v2", text="logo 0"))) == base0


# ---- finding 2 and 5: fetch budgets ------------------------------------------------------


def test_slow_images_share_one_deadline(cluster, srv) -> None:
    """Four images of 0.8 s each under --image-fetch-timeout 2: a deadline per URL let all of
    them through (3.2 s); one deadline for the request refuses it when 2 s are spent."""
    urls = [srv.add(f"slow{i}", make_image(400 + i)) + "?delay=0.8" for i in range(4)]
    t0 = time.monotonic()
    r = chat(cluster.gateway_url, _catalogue(*urls))
    elapsed = time.monotonic() - t0
    assert r.status_code == 422, r.text
    assert "--image-fetch-timeout" in r.json()["error"]["message"]
    assert elapsed < 3.0, elapsed
    one = chat(cluster.gateway_url, _catalogue(urls[0]))  # a request of its own gets its own budget
    assert one.status_code == 200, one.text


def test_images_share_one_byte_budget(cluster, srv) -> None:
    big = [noise_png(500 + i, size=90) for i in range(3)]
    assert all(20_000 < len(b) < 30_000 for b in big), [len(b) for b in big]
    urls = [srv.add(f"big{i}", b) for i, b in enumerate(big)]
    assert chat(cluster.gateway_url, _catalogue(*urls[:2])).status_code == 200
    r = chat(cluster.gateway_url, _catalogue(*urls))  # 3 x ~25 KB > --image-fetch-max-bytes 60000
    assert r.status_code == 413, r.text
    assert "--image-fetch-max-bytes" in r.json()["error"]["message"]


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def test_gzip_bomb_does_not_raise_gateway_memory(cluster, srv) -> None:
    """204 KB of gzip inflating to 200 MiB took the gateway from 81 to 194 MB before its 413."""
    pid = cluster.gateways[0].popen.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _status_kib(pid, "VmRSS")
    r = chat(cluster.gateway_url, _catalogue(f"{srv.base}/bomb"))
    peak = _status_kib(pid, "VmHWM")
    assert r.status_code == 422, r.text
    assert "identity" in r.json()["error"]["message"]
    assert (peak - before) / 1024 < 16, (before, peak)
    _, headers = next(h for h in srv.hits if h[0] == "/bomb")
    assert headers["accept-encoding"] == "identity"


def test_network_failures_do_not_reveal_ports(cluster, srv) -> None:
    answers = {
        path: chat(cluster.gateway_url, _catalogue(f"{srv.base}{path}")).json()["error"]["message"]
        for path in ("/status/404", "/garbage", "/cut")
    }
    assert len(set(answers.values())) == 1, answers
    assert str(srv.port) not in next(iter(answers.values()))
