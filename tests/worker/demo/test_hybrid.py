"""The hybrid demo model (sliding-window + full-attention layers): byte-identical, written without
torch, a Gemma-3 checkpoint transformers loads whole, and render assets the gateway reads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cachekey import ModelAssets, Renderer
from worker.demo.hybrid import SLIDING_WINDOW, write_hybrid_model


def test_byte_identical_and_written_without_torch(tmp_path):
    code = (
        "import sys; from worker.demo.hybrid import write_hybrid_model; "
        f"write_hybrid_model({str(tmp_path / 'a')!r}); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    again = write_hybrid_model(tmp_path / "b")
    files = sorted(p.name for p in again.iterdir())
    assert files == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (again / name).read_bytes(), name


def test_transformers_loads_a_gemma3_with_sliding_window_layers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = write_hybrid_model(tmp_path / "hybrid")
    model, info = transformers.Gemma3ForCausalLM.from_pretrained(
        str(path), output_loading_info=True
    )
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    cfg = model.config
    assert cfg.sliding_window == SLIDING_WINDOW
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    prompt = Renderer(ModelAssets.from_dir(path)).render_chat(
        [{"role": "user", "content": "which layers slide?"}]
    )
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt.token_ids]))
    assert out.logits.shape == (1, len(prompt), cfg.vocab_size)
    assert torch.isfinite(out.logits).all()
    assert ModelAssets.from_dir(path).image is None  # text only: the gateway renders no images
