"""Remote image fetching for the renderer: SSRF-guarded, bounded in size, time and redirects.

The renderer calls the fetcher from the render thread, so it is synchronous. Each hop's host is
resolved once by the `FetchPolicy` (gateway/images/guard.py); the request goes to that checked
address with the original Host header (and, for https, the host name as TLS SNI so the
certificate is still verified against the name). Redirects are followed by hand, each hop
checked again.

A request's fetches share one `FetchBudget`: a deadline for all of them together and a byte
count for all of them together. HTTP is spoken with h11 over a plain socket, so every blocking
call (connect, TLS handshake, send, each recv) waits at most for the time the budget has left:
a slow drip cannot outlast the deadline. The fetcher asks for `Accept-Encoding: identity`,
refuses any other content coding, and counts bytes as they arrive off the socket, so what the
server sends is what is counted (nothing is inflated).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
import time
from collections.abc import Callable
from functools import partial

import h11
import httpx

from cachekey.errors import ImageFetchError, ImageTooLargeError
from cachekey.images import IGNORE_UUIDS, ClientUuids
from cachekey.render import ImageOptions
from gateway.images.guard import FetchPolicy, ImageFetchRefused

log = logging.getLogger(__name__)

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_RECV_BYTES = 64 * 1024
_MAX_HEADER_BYTES = 16 * 1024
TIMEOUT_FLAG = "--image-fetch-timeout"
BYTES_FLAG = "--image-fetch-max-bytes"


class FetchBudget:
    """One request's allowance for all its remote image fetches: time and bytes, together.

    The clock starts at the first fetch (time spent queued for a render thread is not counted).
    Used by one render thread at a time.
    """

    __slots__ = ("_deadline", "max_bytes", "timeout", "used_bytes")

    def __init__(self, timeout: float, max_bytes: int) -> None:
        self.timeout, self.max_bytes = timeout, max_bytes
        self.used_bytes = 0
        self._deadline: float | None = None

    def start(self) -> None:
        if self._deadline is None:
            self._deadline = time.monotonic() + self.timeout

    def seconds_left(self) -> float:
        """The time left (> 0); raises TimeoutError once it is spent."""
        self.start()
        assert self._deadline is not None
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("image fetch budget spent")
        return left

    def bytes_left(self) -> int:
        return self.max_bytes - self.used_bytes

    def timed_out(self) -> ImageFetchError:
        return ImageFetchError(
            f"fetching this request's remote images took longer than {self.timeout:g}s "
            f"({TIMEOUT_FLAG}, for all the request's images together)"
        )

    def over_bytes(self) -> ImageTooLargeError:
        return ImageTooLargeError(
            f"this request's remote images are larger than {self.max_bytes} bytes together "
            f"({BYTES_FLAG})"
        )


def _could_not_fetch() -> ImageFetchError:
    # One message for every network failure: a client must not learn whether a port is open,
    # filtered or serving something other than HTTP.
    return ImageFetchError(
        "could not fetch the image from its URL (connection failed, or the server did not "
        "answer with an image)"
    )


class ImageFetcher:
    def __init__(
        self,
        max_bytes: int = 20 * 1024 * 1024,
        timeout: float = 10.0,
        policy: FetchPolicy | None = None,
        max_redirects: int = 3,
        max_total_bytes: int = 32 * 1024 * 1024,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.max_total_bytes = max_total_bytes
        self.max_redirects = max_redirects
        self.policy = policy or FetchPolicy()
        self._tls = tls or _default_tls()

    def budget(self) -> FetchBudget:
        return FetchBudget(self.timeout, self.max_total_bytes)

    def for_request(self) -> Callable[[str], bytes]:
        """A fetcher for one request: all its calls share one fresh budget."""
        return partial(self.__call__, budget=self.budget())

    def __call__(self, url: str, budget: FetchBudget | None = None) -> bytes:
        budget = budget or self.budget()
        budget.start()
        current = _parse(url)
        try:
            for _ in range(self.max_redirects + 1):
                result = self._hop(current, budget)
                if isinstance(result, bytes):
                    return result
                current = _parse(str(current.join(result)))
        except TimeoutError as e:
            raise budget.timed_out() from e
        except (OSError, h11.ProtocolError, UnicodeError) as e:
            log.info("image fetch from %r failed: %s: %s", current.host, type(e).__name__, e)
            raise _could_not_fetch() from e
        raise ImageFetchRefused(f"image URL redirected more than {self.max_redirects} times")

    def _hop(self, url: httpx.URL, budget: FetchBudget) -> bytes | str:
        """One request: the body, or the Location of a redirect."""
        host = url.raw_host.decode("ascii")
        port = url.port or (443 if url.scheme == "https" else 80)
        ip = self.policy.resolve(host, port, budget.seconds_left())
        sock = socket.create_connection((str(ip), port), timeout=budget.seconds_left())
        try:
            if url.scheme == "https":
                # CPython bounds the whole handshake (not each read) by the socket timeout.
                sock.settimeout(budget.seconds_left())
                sock = self._tls.wrap_socket(sock, server_hostname=host)
            return self._exchange(sock, url, host, budget)
        finally:
            sock.close()

    def _exchange(
        self, sock: socket.socket, url: httpx.URL, host: str, budget: FetchBudget
    ) -> bytes | str:
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEADER_BYTES)
        literal = _is_ip_literal(host)
        name = f"[{host}]" if literal and ":" in host else host
        request = h11.Request(
            method="GET",
            target=url.raw_path,
            headers=[
                ("host", name if url.port is None else f"{name}:{url.port}"),
                ("accept", "image/*"),
                ("accept-encoding", "identity"),
                ("connection", "close"),
                ("user-agent", "kvgate-gateway"),
            ],
        )
        sock.settimeout(budget.seconds_left())  # sendall: the total time of the whole send
        sock.sendall(conn.send(request) + conn.send(h11.EndOfMessage()))
        body = bytearray()
        cap = min(self.max_bytes, budget.bytes_left())
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                sock.settimeout(budget.seconds_left())
                conn.receive_data(sock.recv(_RECV_BYTES))
            elif isinstance(event, h11.Response):
                location = self._check_head(event, cap, budget)
                if location is not None:
                    return location
            elif isinstance(event, h11.Data):
                if len(body) + len(event.data) > cap:
                    raise self._too_large(budget)
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                budget.used_bytes += len(body)
                return bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("closed before the end of the response")
            # InformationalResponse (1xx): keep reading

    def _check_head(self, resp: h11.Response, cap: int, budget: FetchBudget) -> str | None:
        """The redirect target, or None to read the body; raises on anything else."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in resp.headers}
        if resp.status_code in _REDIRECTS:
            location = headers.get("location")
            if not location:
                raise ImageFetchError("image redirect without a Location")
            return location
        if resp.status_code != 200:
            log.info("image fetch answered HTTP %d", resp.status_code)
            raise _could_not_fetch()
        coding = headers.get("content-encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            raise ImageFetchError(
                f"image server answered with content-encoding {coding[:32]!r}; this gateway "
                "asks for and accepts only identity (uncompressed) responses"
            )
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise self._too_large(budget)
        return None

    def _too_large(self, budget: FetchBudget) -> ImageTooLargeError:
        if budget.bytes_left() < self.max_bytes:
            return budget.over_bytes()
        return ImageTooLargeError(
            f"remote image is larger than the limit of {self.max_bytes} bytes (--max-image-bytes)"
        )

    def close(self) -> None:
        self.policy.close()


class RemoteImagesDisabled:
    """The fetcher when --no-remote-images is set: every http(s) image URL is refused."""

    def __call__(self, url: str, budget: FetchBudget | None = None) -> bytes:
        raise ImageFetchRefused(
            "remote image URLs are disabled on this gateway (--no-remote-images); "
            "send the image inline as a data: URL"
        )

    def for_request(self) -> Callable[[str], bytes]:
        return self

    def close(self) -> None:
        pass


def image_options(
    fetcher: ImageFetcher | RemoteImagesDisabled, allow_uuids: bool, tenant: str | None
) -> ImageOptions:
    """One request's image handling: a fresh fetch budget, and what its image `uuid`s mean.

    A client's uuid is ignored (the identifier is the content hash) unless --allow-image-uuids;
    then it is scoped to the tenant ("" without API keys) and can never equal a content hash.
    Either way the gateway forwards the identifier it used as the part's `uuid`, which kvgate
    and vLLM workers take as the item's identifier, so their keys match the gateway's.
    """
    uuids = ClientUuids("scoped", tenant or "") if allow_uuids else IGNORE_UUIDS
    return ImageOptions(fetcher.for_request(), uuids)


def _parse(url: str) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as e:
        raise ImageFetchRefused(f"invalid image URL: {e}") from e
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ImageFetchRefused(f"image URL must be http(s) with a host: {url[:64]!r}")
    if parsed.userinfo:
        raise ImageFetchRefused("image URL must not carry credentials")
    return parsed


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _default_tls() -> ssl.SSLContext:
    """Certificate checks as httpx makes them (certifi's roots), without its connection pool."""
    try:
        import certifi

        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:
        return ssl.create_default_context()
