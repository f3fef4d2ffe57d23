"""The SSRF guard: the address classifier over literal IPs, and the fetcher against 127.0.0.1.

No test here sends a packet outside 127.0.0.0/8: forbidden URLs are refused by the check before
any connection, and the only server is a local one.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cachekey.errors import ImageFetchError, ImageTooLargeError
from gateway.images.fetch import ImageFetcher, RemoteImagesDisabled
from gateway.images.guard import AllowList, FetchPolicy, ImageFetchRefused, forbidden_reason

ip = ipaddress.ip_address


@pytest.mark.parametrize(
    ("addr", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("::1", "loopback"),
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("172.31.255.255", "private"),
        ("192.168.1.1", "private"),
        ("fc00::1", "private"),
        ("fd12:3456::1", "private"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("100.64.0.1", "carrier-grade NAT"),
        ("100.127.255.254", "carrier-grade NAT"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("192.0.2.1", "special-purpose"),  # documentation range
        ("2001:db8::1", "special-purpose"),
        # Ranges the guard missed before (issue 14) and the rest of IANA's special-purpose
        # registries: SIIT and local-use NAT64 (whatever IPv4 they carry), IETF protocol
        # assignments, deprecated site-local, and IPv6 outside global unicast.
        ("::ffff:0:a9fe:a9fe", "translation"),  # SIIT form of 169.254.169.254
        ("::ffff:0:808:808", "translation"),  # even of a public address
        ("64:ff9b:1::a9fe:a9fe", "translation"),
        ("64:ff9b:1::808:808", "translation"),
        ("192.0.0.8", "special-purpose"),
        ("192.0.0.9", "special-purpose"),  # PCP anycast: "globally reachable", still no images
        ("192.0.0.170", "special-purpose"),
        ("fec0::1", "site-local"),
        ("feff::1", "site-local"),
        ("100::1", "special-purpose"),
        ("2001::1", "special-purpose"),  # Teredo
        ("2001:2::1", "special-purpose"),
        ("3fff::1", "special-purpose"),
        ("5f00::1", "special-purpose"),
        ("2620:4f:8000::1", "special-purpose"),
        ("192.88.99.1", "special-purpose"),
        ("192.31.196.1", "special-purpose"),
        ("192.52.193.1", "special-purpose"),
        ("192.175.48.1", "special-purpose"),
        ("198.18.0.1", "special-purpose"),
        ("203.0.113.9", "special-purpose"),
        ("4000::1", "reserved"),  # outside 2000::/3
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped forms are unwrapped
        ("::ffff:10.1.2.3", "private"),
        ("::ffff:169.254.169.254", "cloud metadata"),
        ("2002:a00:1::", "private"),  # 6to4 of 10.0.0.1
        ("64:ff9b::7f00:1", "loopback"),  # NAT64 of 127.0.0.1
    ],
)
def test_forbidden_classes(addr: str, reason: str) -> None:
    got = forbidden_reason(ip(addr))
    assert got is not None and reason in got, (addr, got)


@pytest.mark.parametrize(
    "addr",
    [
        "8.8.8.8",
        "1.1.1.1",
        "93.184.216.34",
        "2606:4700:4700::1111",
        "::ffff:8.8.8.8",
        "64:ff9b::808:808",  # NAT64 (DNS64 clusters) of a public address
        "2002:808:808::1",  # 6to4 of a public address
    ],
)
def test_public_addresses_pass(addr: str) -> None:
    assert forbidden_reason(ip(addr)) is None


def test_allowlist_parse_and_match() -> None:
    allow = AllowList.parse(["Images.Internal.", "10.1.0.0/16", "127.0.0.1", "[::1]"])
    assert allow.allows_host("images.internal")
    assert allow.allows_address(ip("10.1.2.3")) and not allow.allows_address(ip("10.2.0.1"))
    assert allow.allows_address(ip("127.0.0.1")) and allow.allows_address(ip("::1"))
    with pytest.raises(ValueError, match="--image-fetch-allow"):
        AllowList.parse(["10.0.0.0/99"])


def _refusing_resolver(host: str, port: int) -> list[str]:
    raise AssertionError(f"must not resolve {host}")


REFUSED = "is not allowed: this gateway fetches images only from public addresses"


@pytest.mark.parametrize(
    ("url", "logged"),
    [
        ("http://10.0.0.1/a.png", "a private address 10.0.0.1"),
        ("http://169.254.169.254/latest/meta-data", "a cloud metadata address"),
        ("http://[fd00:ec2::254]/", "a cloud metadata address"),
        ("http://[::ffff:7f00:1]:1/", "a loopback"),
        ("http://[::ffff:0:a9fe:a9fe]/latest/meta-data", "a cloud metadata address"),
        ("http://[64:ff9b:1::a00:1]/", "an IPv4/IPv6 translation"),
        ("http://192.0.0.8/", "a special-purpose"),
        ("http://[fec0::1]/", "a site-local"),
        ("http://100.64.1.1/", "a carrier-grade NAT"),
        ("http://metadata.google.internal/computeMetadata/v1/", None),
        ("http://0.0.0.0:1/", "an unspecified"),
    ],
)
def test_refused_before_any_connection(url: str, logged: str | None, caplog) -> None:
    # The resolver would fail the test if called: IP literals and metadata names never resolve.
    f = ImageFetcher(policy=FetchPolicy(resolver=_refusing_resolver))
    caplog.set_level(logging.INFO, logger="gateway.images.guard")
    try:
        with pytest.raises(ImageFetchRefused) as info:
            f(url)
        assert REFUSED in info.value.message and info.value.status_code == 400
        if logged is not None:  # the reason is in the operator's log, not in the answer
            assert logged in caplog.text
    finally:
        f.close()


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("ftp://example.com/a.png", "http(s)"),
        ("http://user:pw@example.com/a.png", "credentials"),
    ],
)
def test_malformed_urls_refused(url: str, needle: str) -> None:
    f = ImageFetcher(policy=FetchPolicy(resolver=_refusing_resolver))
    with pytest.raises(ImageFetchRefused, match=re.escape(needle)):
        f(url)
    f.close()


def test_refusal_never_names_the_resolved_address(caplog) -> None:
    """A name that resolves inside the cluster: the client learns only that it is not allowed."""
    policy = FetchPolicy(resolver=lambda host, port: ["10.96.0.10"])
    caplog.set_level(logging.INFO, logger="gateway.images.guard")
    with pytest.raises(ImageFetchRefused) as info:
        policy.resolve("kube-dns.kube-system.svc.cluster.local", 80, 1.0)
    policy.close()
    assert "10.96.0.10" not in info.value.message and "private" not in info.value.message
    assert "a private address 10.96.0.10" in caplog.text


def test_every_resolved_address_is_checked(caplog) -> None:
    """A name with one public and one private answer is refused (no rebinding by ordering)."""
    policy = FetchPolicy(resolver=lambda host, port: ["93.184.216.34", "10.9.9.9"])
    caplog.set_level(logging.INFO, logger="gateway.images.guard")
    with pytest.raises(ImageFetchRefused, match=REFUSED):
        policy.resolve("mixed.example", 80, 1.0)
    policy.close()
    assert "a private address 10.9.9.9" in caplog.text


def test_allowlisted_host_may_resolve_private_but_never_metadata() -> None:
    allow = AllowList.parse(["images.internal", "169.254.0.0/16", "::/0"])
    policy = FetchPolicy(allow, resolver=lambda host, port: ["10.0.0.7"])
    assert policy.resolve("images.internal", 80, 1.0) == ip("10.0.0.7")
    with pytest.raises(ImageFetchRefused, match=REFUSED):
        policy.resolve("other.internal", 80, 1.0)
    for metadata in ("169.254.169.254", "::ffff:169.254.169.254", "::ffff:0:a9fe:a9fe"):
        with pytest.raises(ImageFetchRefused, match=REFUSED):
            policy.resolve(metadata, 80, 1.0)
    policy.close()


class _Server:
    """A local HTTP server: /img serves bytes, /to?u=URL redirects, /big streams too much."""

    def __init__(self, image: bytes) -> None:
        self.hits: list[tuple[str, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits.append((self.path, self.headers.get("host")))
                if self.path.startswith("/to?u="):
                    self.send_response(302)
                    self.send_header("Location", self.path[len("/to?u=") :])
                    self.end_headers()
                elif self.path == "/big":
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(b"x" * 4096)
                else:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(image)))
                    self.end_headers()
                    self.wfile.write(image)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def server():
    s = _Server(b"\x89PNG fake image bytes")
    yield s
    s.close()


def _fetcher(*allow: str, max_bytes: int = 1024) -> ImageFetcher:
    return ImageFetcher(max_bytes, 5.0, FetchPolicy(AllowList.parse(allow)))


def test_loopback_name_refused_without_allowlist(server) -> None:
    f = _fetcher()
    with pytest.raises(ImageFetchRefused, match=REFUSED) as info:
        f(f"http://localhost:{server.port}/img")
    assert "127.0.0.1" not in info.value.message
    f.close()
    assert server.hits == []  # refused before connecting


def test_allowed_fetch_connects_to_checked_ip_with_host_header(server) -> None:
    f = _fetcher("localhost")
    try:
        assert f(f"http://localhost:{server.port}/img") == b"\x89PNG fake image bytes"
    finally:
        f.close()
    assert server.hits == [("/img", f"localhost:{server.port}")]


def test_redirect_to_metadata_refused_on_the_hop(server) -> None:
    f = _fetcher("127.0.0.1/32")
    url = f"http://127.0.0.1:{server.port}/to?u=http://169.254.169.254/latest/meta-data"
    with pytest.raises(ImageFetchRefused, match=REFUSED):
        f(url)
    f.close()
    assert [p for p, _ in server.hits] == [url.split(str(server.port), 1)[1]]


def test_redirect_hop_is_checked_against_the_allowlist_again(server) -> None:
    """Host allowlisted by name; a redirect to the same server by IP literal is not."""
    f = _fetcher("localhost")
    target = f"http://127.0.0.1:{server.port}/img"
    with pytest.raises(ImageFetchRefused, match=REFUSED):
        f(f"http://localhost:{server.port}/to?u={target}")
    f.close()
    assert len(server.hits) == 1  # the redirect only; the image itself was never requested
    # With the address allowlisted the same chain is fetched.
    g = _fetcher("localhost", "127.0.0.1/32")
    assert g(f"http://localhost:{server.port}/to?u={target}").startswith(b"\x89PNG")
    g.close()


def test_redirect_loop_capped(server) -> None:
    f = _fetcher("127.0.0.1/32")
    base = f"http://127.0.0.1:{server.port}"
    url = f"{base}/to?u={base}/to?u={base}/to?u={base}/to?u={base}/img"
    with pytest.raises(ImageFetchRefused, match="more than 3"):
        f(url)
    f.close()


def test_size_limit_stops_the_stream(server) -> None:
    f = _fetcher("127.0.0.1/32", max_bytes=1000)
    with pytest.raises(ImageTooLargeError, match="--max-image-bytes"):
        f(f"http://127.0.0.1:{server.port}/big")
    f.close()


def test_unresolvable_host_is_a_fetch_error() -> None:
    def nx(host: str, port: int) -> list[str]:
        raise OSError("Name or service not known")

    f = ImageFetcher(policy=FetchPolicy(resolver=nx))
    with pytest.raises(ImageFetchError, match="did not resolve"):
        f("http://no-such-host.invalid/a.png")
    f.close()


def test_remote_images_disabled_names_the_flag() -> None:
    with pytest.raises(ImageFetchRefused, match="--no-remote-images"):
        RemoteImagesDisabled()("https://example.com/a.png")


@pytest.mark.parametrize(
    "url",
    [
        "http://2130706433:9/",  # decimal, hex, octal and short forms of 127.0.0.1
        "http://0x7f000001:9/",
        "http://017700000001:9/",
        "http://127.1:9/",
        "http://LOCALHOST.:9/",
        "http://[::ffff:127.0.0.1]:9/",
    ],
)
def test_odd_spellings_of_loopback_refused(url: str) -> None:
    """Whatever the spelling, the resolved address is what is checked (all are loopback)."""
    f = ImageFetcher(policy=FetchPolicy())
    with pytest.raises(ImageFetchRefused, match=REFUSED):
        f(url)
    f.close()


def test_connects_to_the_address_resolved_once(server) -> None:
    """A name the system cannot resolve is fetched from the address our one lookup returned."""
    calls: list[str] = []

    def rebinding(host: str, port: int) -> list[str]:
        calls.append(host)  # a second lookup would have answered somewhere else
        return ["127.0.0.1"] if len(calls) == 1 else ["10.0.0.1"]

    policy = FetchPolicy(AllowList.parse(["images.test"]), resolver=rebinding)
    f = ImageFetcher(1024, 5.0, policy)
    try:
        assert f(f"http://images.test:{server.port}/img").startswith(b"\x89PNG")
    finally:
        f.close()
    assert calls == ["images.test"]
    assert server.hits == [("/img", f"images.test:{server.port}")]
