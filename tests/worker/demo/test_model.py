"""The generated demo model: byte-identical, loadable by transformers, written without torch."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from worker.demo.model import ensure_demo_model, write_demo_model

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def read_all(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_byte_identical_in_process_and_across_processes(demo_model_dir, tmp_path):
    again = read_all(write_demo_model(tmp_path / "again"))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run(
        [sys.executable, "-m", "worker.demo", str(tmp_path / "other")],
        check=True,
        env=env,
        capture_output=True,
        timeout=120,
    )
    first = read_all(demo_model_dir)
    assert set(first) == EXPECTED_FILES
    assert again == first
    assert read_all(tmp_path / "other") == first


def test_writing_the_demo_model_does_not_import_torch(tmp_path):
    code = (
        "import sys; from worker.demo.model import write_demo_model; "
        f"write_demo_model({str(tmp_path)!r}); assert 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_ensure_demo_model_is_atomic_under_races(tmp_path, monkeypatch, demo_model_dir):
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: ensure_demo_model(), range(4)))
    target = tmp_path / "cache" / "demo-model-v1"
    assert paths == [target] * 4
    assert read_all(target) == read_all(demo_model_dir)
    # No temp directories are left behind by the losers.
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["demo-model-v1"]
    assert ensure_demo_model(tmp_path / "explicit") == tmp_path / "explicit"


def test_transformers_loads_it_with_no_missing_keys_and_runs_an_image(demo_model_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from cachekey import ModelAssets, Renderer

    model, info = transformers.LlavaForConditionalGeneration.from_pretrained(
        str(demo_model_dir), output_loading_info=True
    )
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert info["mismatched_keys"] == []
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 20, 30)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    prompt = Renderer(ModelAssets.from_dir(demo_model_dir)).render_chat(msgs)
    processor = transformers.CLIPImageProcessor.from_pretrained(str(demo_model_dir))
    pixels = processor(images=Image.open(io.BytesIO(buf.getvalue())), return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt.token_ids]), pixel_values=pixels["pixel_values"])
    assert out.logits.shape == (1, len(prompt), model.config.text_config.vocab_size)
    assert torch.isfinite(out.logits).all()
