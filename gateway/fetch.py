"""Remote image fetching for the renderer: bounded size and time, injectable.

The renderer calls the fetcher from the render thread, so it is synchronous. A guard (for
example an SSRF filter) wraps or replaces it: anything `Callable[[str], bytes]` fits.
"""

from __future__ import annotations

import httpx

from cachekey.errors import ImageFetchError, ImageTooLargeError


class ImageFetcher:
    def __init__(self, max_bytes: int = 20 * 1024 * 1024, timeout: float = 10.0) -> None:
        self.max_bytes = max_bytes
        self._client = httpx.Client(timeout=timeout, follow_redirects=False)

    def __call__(self, url: str) -> bytes:
        if not url.startswith(("http://", "https://")):
            raise ImageFetchError(f"unsupported image URL scheme: {url[:32]!r}", param="image_url")
        try:
            with self._client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise ImageFetchError(
                        f"image fetch returned HTTP {resp.status_code}", param="image_url"
                    )
                chunks, size = [], 0
                for chunk in resp.iter_bytes():
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise ImageTooLargeError(
                            f"image larger than {self.max_bytes} bytes", param="image_url"
                        )
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.HTTPError as e:
            raise ImageFetchError(f"image fetch failed: {e}", param="image_url") from e

    def close(self) -> None:
        self._client.close()
