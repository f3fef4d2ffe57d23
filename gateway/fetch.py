"""Remote image fetching for the renderer: SSRF-guarded, bounded in size, time and redirects.

The renderer calls the fetcher from the render thread, so it is synchronous. Each hop's host is
resolved once by the `FetchPolicy` (gateway/image_fetch.py); the request goes to that checked
IP literal with the original Host header (and, for https, the host name as TLS SNI so the
certificate is still verified against the name). Redirects are followed by hand, each hop
checked again. Anything `Callable[[str], bytes]` fits where a different fetcher is wanted.
"""

from __future__ import annotations

import ipaddress
import time

import httpx

from cachekey.errors import ImageFetchError, ImageTooLargeError
from gateway.image_fetch import FetchPolicy, ImageFetchRefused

_REDIRECTS = frozenset({301, 302, 303, 307, 308})


def _pinned(url: httpx.URL, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> httpx.URL:
    literal = f"[{ip}]" if ip.version == 6 else str(ip)
    return url.copy_with(host=literal)


class ImageFetcher:
    def __init__(
        self,
        max_bytes: int = 20 * 1024 * 1024,
        timeout: float = 10.0,
        policy: FetchPolicy | None = None,
        max_redirects: int = 3,
    ) -> None:
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.max_redirects = max_redirects
        self.policy = policy or FetchPolicy()
        # No keep-alive: a pooled TLS connection to one IP must never serve another host name.
        # No proxies from the environment: they would connect somewhere we did not check.
        self._client = httpx.Client(
            follow_redirects=False,
            trust_env=False,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def __call__(self, url: str) -> bytes:
        deadline = time.monotonic() + self.timeout
        current = self._parse(url)
        for _ in range(self.max_redirects + 1):
            try:
                result = self._hop(current, deadline)
            except httpx.TimeoutException as e:
                msg = f"image fetch exceeded the {self.timeout:g}s limit (--image-fetch-timeout)"
                raise ImageFetchError(msg, param="image_url") from e
            except httpx.HTTPError as e:
                msg = f"image fetch failed: {type(e).__name__}"
                raise ImageFetchError(msg, param="image_url") from e
            if isinstance(result, bytes):
                return result
            current = self._parse(str(current.join(result)))
        raise ImageFetchRefused(
            f"image URL redirected more than {self.max_redirects} times", param="image_url"
        )

    @staticmethod
    def _parse(url: str) -> httpx.URL:
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as e:
            raise ImageFetchRefused(f"invalid image URL: {e}", param="image_url") from e
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ImageFetchRefused(
                f"image URL must be http(s) with a host: {url[:64]!r}", param="image_url"
            )
        if parsed.userinfo:
            raise ImageFetchRefused("image URL must not carry credentials", param="image_url")
        return parsed

    def _remaining(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            msg = f"image fetch exceeded the {self.timeout:g}s limit (--image-fetch-timeout)"
            raise ImageFetchError(msg, param="image_url")
        return left

    def _hop(self, url: httpx.URL, deadline: float) -> bytes | str:
        """One request: the body, or the Location of a redirect."""
        port = url.port or (443 if url.scheme == "https" else 80)
        ip = self.policy.resolve(url.host, port, self._remaining(deadline))
        host_header = url.host if url.port is None else f"{url.host}:{url.port}"
        ext = {"sni_hostname": url.host} if url.scheme == "https" else {}
        req = self._client.build_request(
            "GET",
            _pinned(url, ip),
            headers={"host": host_header, "accept": "image/*"},
            timeout=self._remaining(deadline),
            extensions=ext,
        )
        resp = self._client.send(req, stream=True)
        try:
            if resp.status_code in _REDIRECTS:
                location = resp.headers.get("location")
                if not location:
                    raise ImageFetchError("image redirect without a Location", param="image_url")
                return location
            if resp.status_code != 200:
                raise ImageFetchError(
                    f"image fetch returned HTTP {resp.status_code}", param="image_url"
                )
            return self._read(resp, deadline)
        finally:
            resp.close()

    def _read(self, resp: httpx.Response, deadline: float) -> bytes:
        too_large = ImageTooLargeError(
            f"remote image is larger than the limit of {self.max_bytes} bytes (--max-image-bytes)",
            param="image_url",
        )
        declared = resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise too_large
        chunks, size = [], 0
        for chunk in resp.iter_bytes():
            size += len(chunk)
            if size > self.max_bytes:
                raise too_large
            self._remaining(deadline)  # a slow drip must not outlast the overall limit
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self._client.close()
        self.policy.close()


class RemoteImagesDisabled:
    """The fetcher when --no-remote-images is set: every http(s) image URL is refused."""

    def __call__(self, url: str) -> bytes:
        raise ImageFetchRefused(
            "remote image URLs are disabled on this gateway (--no-remote-images); "
            "send the image inline as a data: URL",
            param="image_url",
        )

    def close(self) -> None:
        pass
