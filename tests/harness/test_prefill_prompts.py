"""harness/prefill_prompts.py: the prompts the hidden-state benchmark builds share what they
claim."""

from __future__ import annotations

import random
from pathlib import Path

from cachekey.assets import ModelAssets
from cachekey.render import Renderer
from harness.prefill_prompts import image_prompts, text_prompts


def shared_prefix(prompts) -> int:
    first = prompts[0].token_ids
    return min(
        next((i for i, (a, b) in enumerate(zip(first, p.token_ids, strict=False)) if a != b), 0)
        for p in prompts[1:]
    )


def test_prompts_share_their_prefix(demo_model_dir: Path) -> None:
    renderer = Renderer(ModelAssets.from_dir(demo_model_dir))
    rng = random.Random(0)
    text = text_prompts(4, 600, 0.9, rng)
    images = image_prompts(renderer, 4, 600, 0.9, rng)
    assert [len(p) for p in text] == [600] * 4 and shared_prefix(text) == 540
    assert all(600 <= len(p) < 620 and len(p.mm_items) == 4 for p in images)
    assert shared_prefix(images) >= 0.85 * 600
    assert all(item.end <= shared_prefix(images) for item in images[0].mm_items)
