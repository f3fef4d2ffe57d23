"""Decoded image bytes -> normalised pixel tensor for a fixed-resolution (LLaVA-1.5-style) tower.

Resize to S x S (bicubic), rescale by 1/255, normalise with the model's mean/std, CHW float32.
Deterministic and cheap; Pillow and numpy only (no torchvision).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from cachekey.errors import InvalidImageError
from cachekey.images import open_rgb

# OpenAI CLIP's statistics, the default of CLIP image processors.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(slots=True)
class ImageProcessor:
    image_size: int
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    def __post_init__(self) -> None:
        self.image_mean = tuple(float(x) for x in self.image_mean)
        self.image_std = tuple(float(x) for x in self.image_std)
        if self.image_size <= 0:
            raise ValueError("image_size must be positive")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need one value per RGB channel")
        if any(s == 0 for s in self.image_std):
            raise ValueError("image_std must not contain 0")

    @classmethod
    def from_image_config(cls, image: Any) -> ImageProcessor:
        """From cachekey's ImageConfig (or anything with image_size / image_mean / image_std)."""
        return cls(int(image.image_size), tuple(image.image_mean), tuple(image.image_std))

    def preprocess(self, data: bytes) -> torch.Tensor:
        """Encoded image bytes -> float32 tensor [3, S, S]."""
        try:
            img = open_rgb(data)
            img = img.resize((self.image_size, self.image_size), Image.Resampling.BICUBIC)
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise InvalidImageError(f"cannot decode image: {e}") from e
        pixels = np.asarray(img, dtype=np.float32) * np.float32(1 / 255)
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        pixels = (pixels - mean) / std
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))
