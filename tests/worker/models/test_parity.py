"""Our model implementations against transformers on tiny random checkpoints (float32, 1e-4)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import save_file

from worker.models.attention import ContiguousCacheContext, DenseCausalContext
from worker.models.loader import load_model

TOL = 1e-4
VOCAB = 160


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from the tiny default init, so biases, norms and rotations all matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.15 * noise)


def _hf_text_model(config: transformers.PretrainedConfig, tmp: Path, seed: int = 0, **save_kw):
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomize(hf, seed)
    if config.tie_word_embeddings:
        hf.tie_weights()
    hf.save_pretrained(tmp, safe_serialization=True, **save_kw)
    return hf


def _our_logits(model: torch.nn.Module, input_ids: torch.Tensor, embeds=None) -> torch.Tensor:
    positions = torch.arange(input_ids.shape[0])
    with torch.inference_mode():
        hidden = model(input_ids, positions, DenseCausalContext(), embeds)
        return model.compute_logits(hidden)


def _incremental_logits(model, input_ids: torch.Tensor, split: int, embeds=None) -> torch.Tensor:
    """Prefill input_ids[:split], then decode the rest one token per call through a KV cache."""
    ctx = ContiguousCacheContext()
    chunks = [(0, split)] + [(i, i + 1) for i in range(split, input_ids.shape[0])]
    out = []
    with torch.inference_mode():
        for start, end in chunks:
            chunk_embeds = None if embeds is None else embeds[start:end]
            hidden = model(input_ids[start:end], torch.arange(start, end), ctx, chunk_embeds)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def _prompt(length: int, seed: int = 1, high: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, high, (length,), generator=torch.Generator().manual_seed(seed))


def _tiny_config(cls=transformers.LlamaConfig, **overrides) -> transformers.PretrainedConfig:
    """A tiny two-layer text config over VOCAB; each case below names only what it changes."""
    base = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return cls(**{**base, **overrides})


TEXT_CONFIGS = {
    "llama_gqa": lambda: _tiny_config(max_position_embeddings=256),
    "llama_bias_headdim": lambda: _tiny_config(
        hidden_size=48,
        intermediate_size=80,
        num_key_value_heads=1,
        head_dim=16,
        attention_bias=True,
        mlp_bias=True,
        rope_theta=500.0,
    ),
    "llama3_rope": lambda: _tiny_config(
        num_attention_heads=2,
        rope_theta=5000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama_linear_rope": lambda: _tiny_config(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        rope_scaling={"type": "linear", "factor": 4.0},
    ),
    "llama_yarn_rope": lambda: _tiny_config(
        intermediate_size=64,
        num_attention_heads=2,
        max_position_embeddings=256,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "qwen2_tied": lambda: _tiny_config(transformers.Qwen2Config, tie_word_embeddings=True),
    "mistral": lambda: _tiny_config(transformers.MistralConfig, num_key_value_heads=1),
}


@pytest.mark.parametrize("name", sorted(TEXT_CONFIGS))
def test_text_model_matches_transformers(name: str, tmp_path: Path) -> None:
    config = TEXT_CONFIGS[name]()
    hf = _hf_text_model(config, tmp_path)
    ours = load_model(tmp_path, "cpu", "float32")
    input_ids = _prompt(40)
    with torch.inference_mode():
        expected = hf(input_ids[None]).logits[0]
    got = _our_logits(ours, input_ids)
    assert expected.abs().max() > 0.5  # logits large enough for the comparison to mean something
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    # Prefill then per-token decode through a cache gives the same logits as one full pass.
    incremental = _incremental_logits(ours, input_ids, split=37)
    torch.testing.assert_close(incremental, got, atol=TOL, rtol=0)


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    _hf_text_model(TEXT_CONFIGS["qwen2_tied"](), tmp_path)
    ours = load_model(tmp_path, "cpu", "float32")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf = _hf_text_model(TEXT_CONFIGS["llama_gqa"](), tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = load_model(tmp_path, "cpu", "float32")
    input_ids = _prompt(12, seed=3)
    with torch.inference_mode():
        expected = hf(input_ids[None]).logits[0]
    torch.testing.assert_close(_our_logits(ours, input_ids), expected, atol=TOL, rtol=0)


def _rewrite_checkpoint(tmp_path: Path, edit) -> None:
    from safetensors.torch import load_file

    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_weight_is_a_loud_error(tmp_path: Path) -> None:
    _hf_text_model(TEXT_CONFIGS["llama_gqa"](), tmp_path)
    _rewrite_checkpoint(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 weights.*qkv_proj.weight\[k_proj\]"):
        load_model(tmp_path, "cpu", "float32")


def test_unexpected_weight_is_a_loud_error(tmp_path: Path) -> None:
    _hf_text_model(TEXT_CONFIGS["llama_gqa"](), tmp_path)
    _rewrite_checkpoint(tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected weights.*model\.extra\.weight"):
        load_model(tmp_path, "cpu", "float32")


def test_misshapen_weight_is_a_loud_error(tmp_path: Path) -> None:
    _hf_text_model(TEXT_CONFIGS["llama_gqa"](), tmp_path)
    _rewrite_checkpoint(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape"):
        load_model(tmp_path, "cpu", "float32")


def test_truncated_checkpoint_is_an_error_naming_its_file(tmp_path: Path) -> None:
    """A download cut short: safetensors' own error names no file."""
    _hf_text_model(TEXT_CONFIGS["llama_gqa"](), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        load_model(tmp_path, "cpu", "float32")


# --- LLaVA ---------------------------------------------------------------------------------

IMAGE_TOKEN = VOCAB - 1


def _llava_config(feature_layer=-2, strategy="default") -> transformers.LlavaConfig:
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        projection_dim=16,
    )
    return transformers.LlavaConfig(
        vision_config=vision.to_dict(),
        text_config=_tiny_config().to_dict(),
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
    )


def _hf_llava(config: transformers.LlavaConfig, tmp: Path, seed: int = 0):
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    hf = transformers.LlavaForConditionalGeneration(config).eval()
    _randomize(hf, seed)
    hf.save_pretrained(tmp, safe_serialization=True)
    return hf


def _image_prompt(num_image_tokens: int, num_images: int = 1) -> torch.Tensor:
    parts = [_prompt(5, seed=7, high=VOCAB - 1)]
    for i in range(num_images):
        parts.append(torch.full((num_image_tokens,), IMAGE_TOKEN))
        parts.append(_prompt(4 + i, seed=8 + i, high=VOCAB - 1))
    return torch.cat(parts)


LLAVA_CASES = {
    "default_-2": (-2, "default", 16),
    "full_multi_layer": ([-3, -1], "full", 17),
}


@pytest.mark.parametrize("case", sorted(LLAVA_CASES))
def test_llava_matches_transformers(case: str, tmp_path: Path) -> None:
    feature_layer, strategy, tokens_per_image = LLAVA_CASES[case]
    hf = _hf_llava(_llava_config(feature_layer, strategy), tmp_path)
    ours = load_model(tmp_path, "cpu", "float32")
    assert ours.info.is_multimodal and ours.info.tokens_per_image == tokens_per_image
    pixel_values = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    input_ids = _image_prompt(tokens_per_image, num_images=2)
    with torch.inference_mode():
        expected = hf(input_ids=input_ids[None], pixel_values=pixel_values).logits[0]
        image_embeds = ours.encode_images(pixel_values)
        assert image_embeds.shape == (2, tokens_per_image, 64)
        embeds = ours.embed_with_images(input_ids, image_embeds.reshape(-1, 64))
    got = _our_logits(ours, input_ids, embeds)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    # The image changes the logits, so the comparison above really covers the vision path.
    with torch.inference_mode():
        other = hf(input_ids=input_ids[None], pixel_values=pixel_values.flip(0)).logits[0]
    assert (other - expected).abs().max() > 1e-2
    split = input_ids.shape[0] - 3
    torch.testing.assert_close(
        _incremental_logits(ours, input_ids, split, embeds), got, atol=TOL, rtol=0
    )


def _llava_parts(hf) -> dict[str, dict[str, torch.Tensor]]:
    """The HF model's tensors by component, whichever transformers built it: 4.x nests the CLIP
    tower under `vision_model.`, 5.x does not."""
    parts: dict[str, dict[str, torch.Tensor]] = {"text": {}, "tower": {}, "proj": {}, "head": {}}
    prefixes = (
        ("model.language_model.", "text"),
        ("model.vision_tower.vision_model.", "tower"),
        ("model.vision_tower.", "tower"),
        ("model.multi_modal_projector.", "proj"),
        ("lm_head.", "head"),
    )
    for name, tensor in hf.state_dict().items():
        prefix, part = next((p, part) for p, part in prefixes if name.startswith(p))
        parts[part][name[len(prefix) :]] = tensor.contiguous()
    return parts


# Checkpoint layouts: transformers <4.52 save_pretrained; 4.52+ state dict and save; 5.x
# save_pretrained (checked against transformers 5.17) and 5.x state dict.
LLAVA_LAYOUTS = {
    "classic": (
        "language_model.model.",
        "vision_tower.vision_model.",
        "multi_modal_projector.",
        "language_model.lm_head.",
    ),
    "v4_nested": (
        "model.language_model.",
        "model.vision_tower.vision_model.",
        "model.multi_modal_projector.",
        "lm_head.",
    ),
    "v5_saved": (
        "language_model.model.",
        "vision_tower.",
        "multi_modal_projector.",
        "language_model.lm_head.",
    ),
    "v5_state_dict": (
        "model.language_model.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
        "lm_head.",
    ),
}


def test_llava_loads_every_checkpoint_layout_identically(tmp_path: Path) -> None:
    """The same weights written in each layout load into the same model: identical outputs."""
    hf = _hf_llava(_llava_config(), tmp_path / "hf")
    parts = _llava_parts(hf)
    assert all(parts.values())
    pixel_values = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    input_ids = _image_prompt(16)
    with torch.inference_mode():
        expected = hf(input_ids=input_ids[None], pixel_values=pixel_values).logits[0]
    outputs = {}
    for layout, prefixes in LLAVA_LAYOUTS.items():
        out_dir = tmp_path / layout
        out_dir.mkdir()
        (out_dir / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
        state = {
            prefix + name: tensor
            for prefix, part in zip(prefixes, ("text", "tower", "proj", "head"), strict=True)
            for name, tensor in parts[part].items()
        }
        save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
        ours = load_model(out_dir, "cpu", "float32")
        with torch.inference_mode():
            embeds = ours.embed_with_images(input_ids, ours.encode_images(pixel_values)[0])
        outputs[layout] = _our_logits(ours, input_ids, embeds)
    for layout, got in outputs.items():
        assert torch.equal(got, outputs["classic"]), layout
    torch.testing.assert_close(outputs["classic"], expected, atol=TOL, rtol=0)


def test_llava_old_buffers_in_checkpoint_are_skipped(tmp_path: Path) -> None:
    _hf_llava(_llava_config(), tmp_path)
    position_ids = torch.arange(17)[None]
    _rewrite_checkpoint(
        tmp_path,
        lambda t: t.update({"vision_tower.vision_model.embeddings.position_ids": position_ids}),
    )
    assert load_model(tmp_path, "cpu", "float32").info.tokens_per_image == 16


def test_llava_placeholder_count_mismatch_is_an_error(tmp_path: Path) -> None:
    _hf_llava(_llava_config(), tmp_path)
    ours = load_model(tmp_path, "cpu", "float32")
    input_ids = _image_prompt(16)
    with torch.inference_mode():
        embeds = ours.encode_images(torch.zeros(1, 3, 32, 32))[0]
        with pytest.raises(ValueError, match="16 image placeholder tokens but 15"):
            ours.embed_with_images(input_ids, embeds[:15])
        with pytest.raises(ValueError, match="placeholder"):
            ours(input_ids, torch.arange(input_ids.shape[0]), DenseCausalContext())


# --- the demo model ------------------------------------------------------------------------


def test_demo_model_matches_transformers(demo_model_dir: Path) -> None:
    from cachekey.assets import ModelAssets
    from worker.models.image_processor import ImageProcessor

    hf = transformers.AutoModelForImageTextToText.from_pretrained(
        demo_model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ours = load_model(demo_model_dir, "cpu", "float32")
    assets = ModelAssets.from_dir(demo_model_dir)
    assert assets.image is not None
    info = ours.info
    assert info.image_token_id == assets.image.image_token_id
    assert info.tokens_per_image == assets.image.tokens_per_image

    processor = ImageProcessor.from_image_config(assets.image)
    text = assets.tokenizer.encode("describe this picture").ids
    ids = text[:2] + [info.image_token_id] * info.tokens_per_image + text[2:]
    input_ids = torch.tensor(ids)
    logits = []
    for image in (_solid_png(50, 30, (200, 40, 90)), _solid_png(64, 64, (10, 220, 30))):
        pixel_values = processor.preprocess(image)[None]
        with torch.inference_mode():
            expected = hf(input_ids=input_ids[None], pixel_values=pixel_values).logits[0]
            embeds = ours.embed_with_images(input_ids, ours.encode_images(pixel_values)[0])
        got = _our_logits(ours, input_ids, embeds)
        torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
        logits.append(got)
    # Different images give different logits, so the vision path is part of the comparison.
    assert (logits[0] - logits[1]).abs().max() > 10 * TOL


def _solid_png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def test_bfloat16_load_runs_close_to_float32(tmp_path: Path) -> None:
    """The half-precision path (GPU default) works end to end, images included."""
    _hf_llava(_llava_config(), tmp_path)
    input_ids = _image_prompt(16)
    pixel_values = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(tmp_path, "cpu", dtype)
        assert model.info.dtype == dtype
        assert all(p.dtype == dtype for p in model.parameters())
        with torch.inference_mode():
            embeds = model.embed_with_images(input_ids, model.encode_images(pixel_values)[0])
        assert embeds.dtype == dtype
        results.append(_our_logits(model, input_ids, embeds).float())
    full, half = results
    assert (full - half).abs().max() < 0.05 * full.abs().max()
