"""Rendering chat and completion requests into Prompts, and the keys those Prompts get."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from cachekey import HashNamespace, ModelAssets, Renderer, block_keys, image_identifier

BS = 16


def png(color: tuple[int, int, int], size: tuple[int, int] = (32, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def chat(image: bytes | None = None, uuid: str | None = None, text: str = "Describe it.") -> list:
    parts: list[dict] = [{"type": "text", "text": text}]
    if image is not None:
        part = {"type": "image_url", "image_url": {"url": data_url(image)}}
        if uuid is not None:
            part["uuid"] = uuid
        parts.append(part)
    return [
        {"role": "system", "content": "You are a careful assistant. " * 6},
        {"role": "user", "content": parts},
    ]


@pytest.fixture(scope="module")
def assets(demo_model_dir: Path) -> ModelAssets:
    return ModelAssets.from_dir(demo_model_dir)


@pytest.fixture(scope="module")
def renderer(assets: ModelAssets) -> Renderer:
    return Renderer(assets)


def keys_of(prompt, ns=HashNamespace("demo", BS)) -> list[bytes]:
    return block_keys(prompt.token_ids, ns, prompt.mm_items)


def test_image_placeholder_is_expanded_and_recorded(renderer, assets):
    raw = png((200, 10, 10))
    prompt = renderer.render_chat(chat(raw))
    (item,) = prompt.mm_items
    n = assets.image.tokens_per_image
    assert n == 64 and item.length == n and item.modality == "image"
    assert item.identifier == image_identifier(raw)
    span = prompt.token_ids[item.offset : item.end]
    assert span == (assets.image.image_token_id,) * n
    assert prompt.token_ids.count(assets.image.image_token_id) == n
    assert prompt.mm_data == {item.identifier: raw}
    assert prompt.token_ids[0] == assets.tokenizer.token_to_id("<s>")


def test_several_images_keep_part_order(renderer):
    a, b = png((1, 2, 3)), png((4, 5, 6))
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(a)}},
                {"type": "text", "text": "and"},
                {"type": "input_image", "image_url": data_url(b)},
            ],
        }
    ]
    prompt = renderer.render_chat(msgs)
    first, second = prompt.mm_items
    assert (first.identifier, second.identifier) == (image_identifier(a), image_identifier(b))
    assert first.end < second.offset


def test_matches_transformers_apply_chat_template(renderer, assets, demo_model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(demo_model_dir))
    msgs = chat(png((9, 9, 9)))
    hf_msgs = [
        {"role": "system", "content": msgs[0]["content"]},
        {"role": "user", "content": [{"type": "text", "text": "Describe it."}, {"type": "image"}]},
        {"role": "assistant", "content": "A grey square."},
        {"role": "user", "content": "Thanks! <|im_start|> is not a turn here, é ü 漢字"},
    ]
    ours_msgs = [*msgs, *hf_msgs[2:]]
    text = hf.apply_chat_template(hf_msgs, tokenize=False, add_generation_prompt=True)
    hf_ids = hf(text, add_special_tokens=False).input_ids
    expanded = []
    for t in hf_ids:
        expanded += [t] * 64 if t == assets.image.image_token_id else [t]
    assert list(renderer.render_chat(ours_msgs).token_ids) == expanded


def test_same_request_in_two_processes_gives_same_ids_and_keys(renderer, demo_model_dir):
    script = r"""
import base64, io, json, sys
from PIL import Image
from cachekey import HashNamespace, ModelAssets, Renderer, block_keys
buf = io.BytesIO(); Image.new("RGB", (40, 30), (7, 70, 140)).save(buf, "PNG")
url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
msgs = [{"role": "system", "content": "Be brief. " * 20},
        {"role": "user", "content": [{"type": "text", "text": "What color?"},
                                     {"type": "image_url", "image_url": {"url": url}}]}]
p = Renderer(ModelAssets.from_dir(sys.argv[1])).render_chat(msgs)
keys = block_keys(p.token_ids, HashNamespace("demo", 16), p.mm_items, "lora-x", "salt-y")
items = [[m.identifier, m.offset, m.length] for m in p.mm_items]
print(json.dumps({"ids": list(p.token_ids), "items": items, "keys": [k.hex() for k in keys]}))
"""
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", script, str(demo_model_dir)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=True,
        )
        outs.append(json.loads(run.stdout))
    assert outs[0] == outs[1]
    assert len(outs[0]["keys"]) == len(outs[0]["ids"]) // BS > 4
    assert outs[0]["items"][0][2] == 64


def test_requests_differing_only_in_image_share_keys_before_the_span(renderer):
    a = renderer.render_chat(chat(png((255, 0, 0))))
    b = renderer.render_chat(chat(png((0, 0, 255))))
    assert a.token_ids == b.token_ids  # same placeholders: only the extra keys tell them apart
    (item,) = a.mm_items
    ka, kb = keys_of(a), keys_of(b)
    before = item.offset // BS  # blocks [0, before) end at or before the span start
    assert before >= 2
    assert ka[:before] == kb[:before]
    assert all(x != y for x, y in zip(ka[before:], kb[before:], strict=True))


def test_same_bytes_or_same_uuid_give_identical_keys(renderer):
    raw = png((10, 200, 10))
    assert keys_of(renderer.render_chat(chat(raw))) == keys_of(renderer.render_chat(chat(raw)))
    u1 = renderer.render_chat(chat(png((1, 1, 1)), uuid="product-42"))
    u2 = renderer.render_chat(chat(png((2, 2, 2)), uuid="product-42"))
    assert u1.mm_items[0].identifier == "product-42"
    assert keys_of(u1) == keys_of(u2)
    assert keys_of(u1) != keys_of(renderer.render_chat(chat(png((1, 1, 1)))))


def test_lora_and_salt_change_every_key_of_a_rendered_prompt(renderer):
    p = renderer.render_chat(chat(png((3, 3, 3))))
    ns = HashNamespace("demo", BS)
    base = block_keys(p.token_ids, ns, p.mm_items)
    for kw in ({"lora_name": "a"}, {"cache_salt": "s"}):
        other = block_keys(p.token_ids, ns, p.mm_items, **kw)
        assert all(x != y for x, y in zip(base, other, strict=True))


def test_text_only_chat_and_generation_prompt(renderer, assets):
    msgs = [{"role": "user", "content": "hello there"}]
    with_gen = renderer.render_chat(msgs)
    without = renderer.render_chat(msgs, add_generation_prompt=False)
    assert with_gen.token_ids[: len(without)] == without.token_ids
    assert renderer.decode(with_gen.token_ids[len(without) :], False) == "<|im_start|>assistant\n"
    assert with_gen.mm_items == () and with_gen.mm_data == {}


def test_assistant_tool_calls_with_null_content_and_tools(renderer):
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    plain = renderer.decode(renderer.render_chat(msgs).token_ids, False)
    assert '"id": "c1"' in plain and "<|im_start|>tool\nsunny" in plain
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    with_tools = renderer.decode(renderer.render_chat(msgs, tools=tools).token_ids, False)
    assert "get_weather" in with_tools and "get_weather" not in plain


def test_completion_string_gets_bos_and_id_lists_pass_through(renderer, assets):
    p = renderer.render_completion("The cache block")
    bos = assets.tokenizer.token_to_id("<s>")
    assert p.token_ids == (
        bos,
        *assets.tokenizer.encode("The cache block", add_special_tokens=False).ids,
    )
    assert p.token_ids == tuple(assets.tokenizer.encode("The cache block").ids)
    assert renderer.render_completion([5, 6, 7]).token_ids == (5, 6, 7)
    assert renderer.decode(p.token_ids) == "The cache block"


def test_remote_images_use_the_injected_fetcher(assets):
    raw = png((50, 60, 70))
    seen = []

    def fetch(url: str) -> bytes:
        seen.append(url)
        return raw

    msgs = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}],
        }
    ]
    prompt = Renderer(assets, fetcher=fetch).render_chat(msgs)
    assert seen == ["https://x/a.png"]
    assert prompt.mm_items[0].identifier == image_identifier(raw)
    assert prompt.mm_data[image_identifier(raw)] == raw


# Frozen once: the demo model's render assets and a rendered prompt's keys. A change here means
# every gateway and worker built from this revision disagrees with older ones (or the demo model
# is no longer byte-identical, e.g. after a tokenizers upgrade changed BPE training).
GOLDEN_DEMO_FINGERPRINT = "b09dedf85a1eb65c52f88bec48d7eb42b24025ace89681f78f3ff5be18f0a878"
GOLDEN_DEMO_KEYS = "733335dcd26d1f3a25e01254b37f7415f9c1198a74744e4abc5b574d604a3a71"


def test_golden_demo_render_and_keys(renderer, assets):
    prompt = renderer.render_chat(chat(png((12, 34, 56)), uuid="golden-image"))
    digest = hashlib.sha256(b"".join(keys_of(prompt))).hexdigest()
    assert assets.fingerprint() == GOLDEN_DEMO_FINGERPRINT
    assert (len(prompt), digest) == (156, GOLDEN_DEMO_KEYS)
