"""Image bytes: data-URL decoding, content identifiers, and header-only probing.

The gateway hashes and probes every image on the request path, so nothing here decodes pixels
(Pillow's Image.open reads the header only); the worker decodes pixels with `open_rgb`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass

import xxhash
from PIL import Image

from cachekey.errors import ImageTooLargeError, InvalidImageError

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_PILLOW_COUNT = re.compile(r"\((\d+) pixels\)")  # in "Image size (N pixels) exceeds limit of"
# Pillow refuses an image past twice its MAX_IMAGE_PIXELS whatever our limit says: a higher
# `--max-image-pixels` could never take effect, so it is refused at start.
PILLOW_MAX_PIXELS = 2 * (Image.MAX_IMAGE_PIXELS or 0) or None


def decode_data_url(url: str, max_bytes: int | None = None, *, param: str | None = None) -> bytes:
    """The bytes of a base64 `data:` URL (`data:image/png;base64,...`)."""
    if not url.startswith("data:"):
        raise InvalidImageError("image URL is not a data: URL", param=param)
    header, sep, payload = url.partition(",")
    if not sep:
        raise InvalidImageError("data: URL has no ',' separating the header and data", param=param)
    if not header.endswith(";base64"):
        raise InvalidImageError(
            "data: URL must be base64-encoded (data:image/<format>;base64,<data>)", param=param
        )
    if max_bytes is not None and len(payload) // 4 * 3 > max_bytes:
        raise ImageTooLargeError(
            f"image data is larger than the limit of {max_bytes} bytes", param=param
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        # Some clients wrap base64 at 76 columns; accept whitespace, nothing else.
        try:
            return base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise InvalidImageError(f"image data is not valid base64: {e}", param=param) from e


def image_identifier(data: bytes) -> str:
    """The content identifier of an image: xxh3_128 hex of its encoded bytes."""
    return xxhash.xxh3_128_hexdigest(data)


_UUID_DOMAIN = b"kvgate/image-uuid/v1"
UUID_IDENTIFIER_PREFIX = "uuid-"


def scoped_uuid_identifier(scope: str, uuid: str) -> str:
    """A client's image `uuid` as an identifier inside `scope` (the gateway's tenant).

    SHA-256 over length-prefixed (domain, scope, uuid): one scope's uuid never names another
    scope's image, and the "uuid-" prefix keeps it apart from every content identifier (bare
    hex), whatever the client sends.
    """
    h = hashlib.sha256()
    for part in (
        _UUID_DOMAIN,
        scope.encode("utf-8", "surrogatepass"),
        uuid.encode("utf-8", "surrogatepass"),
    ):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return UUID_IDENTIFIER_PREFIX + h.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class ClientUuids:
    """What an image part's client-supplied `uuid` does to the image's identifier.

    - "verbatim": the uuid is the identifier (vLLM's meaning). For a worker behind the gateway,
      which receives the gateway's identifiers as uuids.
    - "ignore": the identifier is always the content hash (the gateway's default).
    - "scoped": the identifier is `scoped_uuid_identifier(scope, uuid)` (--allow-image-uuids).
    """

    mode: str = "verbatim"
    scope: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("verbatim", "ignore", "scoped"):
            raise ValueError(f"ClientUuids.mode must be verbatim, ignore or scoped: {self.mode!r}")

    def identifier(self, uuid: str | None, data: bytes) -> str:
        if uuid is None or self.mode == "ignore":
            return image_identifier(data)
        if self.mode == "verbatim":
            return uuid
        return scoped_uuid_identifier(self.scope, uuid)


VERBATIM_UUIDS = ClientUuids()
IGNORE_UUIDS = ClientUuids("ignore")


def probe_image(
    data: bytes, max_pixels: int | None = None, *, param: str | None = None
) -> tuple[int, int, str]:
    """(width, height, format) from the image header, without decoding the pixels."""
    if not data:
        raise InvalidImageError("image data is empty", param=param)
    # Pillow's own bomb check errors past 2x MAX_IMAGE_PIXELS; below that our limit decides
    # (warnings.catch_warnings would be cheaper to read but is not thread-safe).
    try:
        img = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
        width, height, fmt = img.width, img.height, img.format or "unknown"
    except Image.DecompressionBombError as e:
        raise _over_pillow_cap(e, max_pixels, param) from e
    except (OSError, ValueError, SyntaxError) as e:
        raise InvalidImageError(
            f"data is not an image in a supported format ({', '.join(SUPPORTED_FORMATS)})",
            param=param,
        ) from e
    if width <= 0 or height <= 0:
        raise InvalidImageError(f"image has an empty size {width}x{height}", param=param)
    if max_pixels is not None and width * height > max_pixels:
        raise ImageTooLargeError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}",
            param=param,
        )
    return width, height, fmt


def check_max_pixels(max_pixels: int) -> None:
    """A `--max-image-pixels` that can take effect (gateway and worker): ValueError if not."""
    if max_pixels <= 0:
        raise ValueError("--max-image-pixels must be positive")
    if PILLOW_MAX_PIXELS is not None and max_pixels > PILLOW_MAX_PIXELS:
        raise ValueError(
            f"--max-image-pixels {max_pixels} is over {PILLOW_MAX_PIXELS}, past which the "
            "image decoder (Pillow) refuses an image itself"
        )


def _over_pillow_cap(
    e: Image.DecompressionBombError, max_pixels: int | None, param: str | None
) -> ImageTooLargeError:
    """An image past Pillow's own cap (2x MAX_IMAGE_PIXELS), refused in the words of our limit:
    Pillow's message names its cap, which no flag sets."""
    cap = PILLOW_MAX_PIXELS or 0
    count = _PILLOW_COUNT.search(str(e))
    pixels = count[1] if count else f"over {cap}"
    limit = max_pixels if max_pixels is not None and max_pixels < cap else cap
    return ImageTooLargeError(f"image is {pixels} pixels, over the limit of {limit}", param=param)


def open_rgb(data: bytes) -> Image.Image:
    """Decode an image to RGB pixels (the first frame of an animation)."""
    img = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    img.seek(0)
    return img.convert("RGB")
