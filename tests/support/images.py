"""Images the tests send, beside harness.workload's `make_image` (small and compressible)."""

from __future__ import annotations

import io
import random

from PIL import Image


def noise_png(seed: int, size: int) -> bytes:
    """A PNG that does not compress: about 3 bytes a pixel."""
    rng = random.Random(seed)
    raw = bytes(rng.randrange(256) for _ in range(size * size * 3))
    buf = io.BytesIO()
    Image.frombytes("RGB", (size, size), raw).save(buf, format="PNG")
    return buf.getvalue()
