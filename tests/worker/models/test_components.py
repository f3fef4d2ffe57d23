"""Model building blocks: image preprocessing, rope config spellings, ModelInfo, embedding merge."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from cachekey.errors import InvalidImageError
from worker.models.image_processor import CLIP_MEAN, CLIP_STD, ImageProcessor
from worker.models.llava import merge_embeddings
from worker.models.loader import llava_checkpoint_name, read_model_info, resolve_dtype
from worker.models.rotary import RotaryEmbedding, rope_settings


def _png(width: int, height: int, seed: int = 0, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    arr = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("width", "height", "mode"), [(50, 30, "RGB"), (64, 64, "RGBA"), (7, 90, "RGB")]
)
def test_image_processor_matches_clip_image_processor(width: int, height: int, mode: str) -> None:
    data = _png(width, height, seed=width, mode=mode)
    ours = ImageProcessor(image_size=64).preprocess(data)
    hf_proc = transformers.CLIPImageProcessor(
        size={"height": 64, "width": 64},
        do_center_crop=False,
        resample=Image.Resampling.BICUBIC,
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
    )
    image = Image.open(io.BytesIO(data)).convert("RGB")
    expected = hf_proc(images=image, return_tensors="pt")["pixel_values"][0]
    assert ours.shape == (3, 64, 64) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_image_processor_is_deterministic_and_resizes() -> None:
    proc = ImageProcessor(image_size=32, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
    a, b = _png(40, 40, seed=1), _png(20, 50, seed=2)
    pa, pb = proc.preprocess(a), proc.preprocess(b)
    assert pa.shape == pb.shape == (3, 32, 32)
    assert torch.equal(pa, proc.preprocess(a))
    assert not torch.equal(pa, pb)
    assert min(pa.min(), pb.min()) >= -1.0 and max(pa.max(), pb.max()) <= 1.0


def test_image_processor_rejects_garbage() -> None:
    with pytest.raises(InvalidImageError):
        ImageProcessor(image_size=32).preprocess(b"not an image at all")
    with pytest.raises(ValueError, match="image_std"):
        ImageProcessor(image_size=32, image_std=(0.0, 1.0, 1.0))


def test_rope_parameters_spelling_equals_rope_scaling() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    old = {"rope_theta": 5000.0, "rope_scaling": scaling}
    new = {"rope_parameters": {"rope_theta": 5000.0, **scaling}}
    assert rope_settings(old) == rope_settings(new)
    assert rope_settings(old)[0] == 5000.0
    positions = torch.arange(300)
    q = torch.randn(300, 2, 16)
    rot_old = RotaryEmbedding.from_config(old, 16, 2048)
    rot_new = RotaryEmbedding.from_config(new, 16, 2048)
    plain = RotaryEmbedding.from_config({"rope_theta": 5000.0}, 16, 2048)
    assert torch.equal(rot_old(positions, q, q)[0], rot_new(positions, q, q)[0])
    assert not torch.allclose(rot_old(positions, q, q)[0], plain(positions, q, q)[0])


def test_rope_rotation_depends_only_on_each_tokens_position() -> None:
    rot = RotaryEmbedding.from_config({"rope_theta": 10000.0}, 8, 512)
    q = torch.randn(10, 2, 8)
    positions = torch.arange(100, 110)
    whole = rot(positions, q, q)[0]
    pieces = torch.cat(
        [rot(positions[i : i + 1], q[i : i + 1], q[i : i + 1])[0] for i in range(10)]
    )
    torch.testing.assert_close(whole, pieces, atol=1e-6, rtol=0)
    # A rotation keeps the norm of each head vector.
    torch.testing.assert_close(whole.norm(dim=-1), q.norm(dim=-1), atol=1e-5, rtol=0)


def test_dynamic_rope_is_refused() -> None:
    with pytest.raises(ValueError, match="dynamic"):
        RotaryEmbedding.from_config({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 8, 64)


def test_merge_embeddings_with_a_mask_for_a_partial_chunk() -> None:
    embeds = torch.zeros(6, 4)
    mask = torch.tensor([False, True, True, False, False, True])
    rows = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1
    merged = merge_embeddings(embeds, mask, rows)
    assert torch.equal(merged[mask], rows)
    assert torch.equal(merged[~mask], torch.zeros(3, 4))
    assert torch.equal(embeds, torch.zeros(6, 4))  # the input is left alone
    with pytest.raises(ValueError, match="3 image placeholder tokens but 2"):
        merge_embeddings(embeds, mask, rows[:2])


def test_model_info_from_config_without_weights(tmp_path: Path) -> None:
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=64,
        patch_size=8,
    )
    text = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    transformers.LlavaConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=99
    ).save_pretrained(tmp_path)
    info = read_model_info(tmp_path)
    assert info.architecture == "LlavaForConditionalGeneration"
    assert info.is_multimodal and info.image_token_id == 99 and info.tokens_per_image == 64
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (3, 2, 16)
    assert info.kv_bytes_per_token() == 2 * 3 * 2 * 16 * 4
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model"):
        read_model_info(tmp_path)


def test_llava_checkpoint_names_map_to_the_classic_layout() -> None:
    assert llava_checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight") == (
        "language_model.model.layers.0.mlp.up_proj.weight"
    )
    assert llava_checkpoint_name("lm_head.weight") == "language_model.lm_head.weight"
    assert llava_checkpoint_name("model.vision_tower.vision_model.pre_layrnorm.bias") == (
        "vision_tower.vision_model.pre_layrnorm.bias"
    )
    classic = "language_model.model.norm.weight"
    assert llava_checkpoint_name(classic) == classic


def test_resolve_dtype() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, cpu) == torch.float32
    assert resolve_dtype("bfloat16", {}, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", {}, cpu)
