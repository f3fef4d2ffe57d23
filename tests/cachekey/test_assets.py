"""ModelAssets from a directory or a files dict: templates, special tokens, image settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachekey import AssetError, ModelAssets, Renderer


@pytest.fixture(scope="module")
def files(demo_model_dir: Path) -> dict[str, bytes]:
    return ModelAssets.from_dir(demo_model_dir).files


def with_json(files: dict[str, bytes], name: str, **changes) -> dict[str, bytes]:
    obj = json.loads(files[name])
    obj.update(changes)
    return {**files, name: json.dumps(obj).encode()}


def test_demo_assets(files):
    a = ModelAssets.from_files(files)
    assert a.image is not None and a.image.tokens_per_image == 64
    assert a.image.image_token == "<image>" and a.image.image_size == 64
    assert a.bos_token == "<s>" and a.eos_token == "</s>"
    tok = a.tokenizer
    assert set(a.eos_token_ids) == {tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>")}
    assert a.max_model_len == 4096
    assert "model.safetensors" not in a.files  # weights never travel to a gateway


def test_from_files_equals_from_dir(demo_model_dir, files):
    assert ModelAssets.from_files(files).fingerprint() == (
        ModelAssets.from_dir(demo_model_dir).fingerprint()
    )


def test_fingerprint_follows_what_determines_tokens(files):
    base = ModelAssets.from_files(files)
    assert len(base.fingerprint()) == 64
    other_template = ModelAssets.from_files({**files, "chat_template.jinja": b"{{ messages }}"})
    assert other_template.fingerprint() != base.fingerprint()
    cfg = json.loads(files["config.json"])
    cfg["vision_config"]["patch_size"] = 16
    smaller = ModelAssets.from_files({**files, "config.json": json.dumps(cfg).encode()})
    assert smaller.image.tokens_per_image == 16
    parts, other = base.fingerprint_parts(), smaller.fingerprint_parts()
    assert [k for k in parts if parts[k] != other[k]] == ["image"]
    # Unrelated config (say, the number of layers) does not move it.
    cfg = json.loads(files["config.json"])
    cfg["text_config"]["num_hidden_layers"] = 7
    same = ModelAssets.from_files({**files, "config.json": json.dumps(cfg).encode()})
    assert same.fingerprint() == base.fingerprint()


def test_full_feature_strategy_keeps_cls(files):
    a = ModelAssets.from_files(
        with_json(files, "config.json", vision_feature_select_strategy="full")
    )
    assert a.image.tokens_per_image == 65


def test_named_templates_and_added_token_dicts(files):
    named = [
        {"name": "default", "template": "D{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        {"name": "tool_use", "template": "T"},
    ]
    changed = with_json(
        files,
        "tokenizer_config.json",
        chat_template=named,
        bos_token={"content": "<s>", "lstrip": False, "__type": "AddedToken"},
    )
    a = ModelAssets.from_files(changed)
    assert a.chat_template == named[0]["template"] and set(a.chat_templates) == {
        "default",
        "tool_use",
    }
    assert a.bos_token == "<s>"
    assert (
        Renderer(a).decode(Renderer(a).render_chat([{"role": "user", "content": "xy"}]).token_ids)
        == "Dxy"
    )


def test_chat_template_jinja_wins(files):
    a = ModelAssets.from_files({**files, "chat_template.jinja": b"J"})
    assert a.chat_template == "J"
    only_json = with_json(files, "tokenizer_config.json", chat_template=None)
    only_json["chat_template.json"] = json.dumps({"chat_template": "C"}).encode()
    assert ModelAssets.from_files(only_json).chat_template == "C"


def test_text_only_config_has_no_image_support(files):
    text_cfg = {"model_type": "llama", "max_position_embeddings": 8192}
    a = ModelAssets.from_files({**files, "config.json": json.dumps(text_cfg).encode()})
    assert a.image is None and a.max_model_len == 8192


def test_broken_assets_are_reported(files, tmp_path):
    with pytest.raises(AssetError, match=r"tokenizer\.json"):
        ModelAssets.from_dir(tmp_path)
    with pytest.raises(AssetError, match="not valid JSON"):
        ModelAssets.from_files({**files, "config.json": b"{nope"})
    with pytest.raises(AssetError, match="not in the tokenizer"):
        ModelAssets.from_files(with_json(files, "config.json", image_token_index=10**6))
    with pytest.raises(AssetError, match="does not load"):
        ModelAssets.from_files({**files, "tokenizer.json": b"{}"})
