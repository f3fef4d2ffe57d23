"""End to end against transformers: paged attention, chunked prefill and batching on a text-only
GQA Llama give the same greedy tokens as Hugging Face's own generate()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachekey import Prompt
from tests.support.engine import make_engine, run_all, tokens
from tests.support.lora_fixtures import write_tiny_llama
from worker.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_llama_dir(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), demo_model_dir)


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return out[0, len(prompt) :].tolist()


def test_engine_matches_transformers_generate(tiny_llama_dir: Path) -> None:
    prompts = [
        [(7 * i + 13 * j) % 1900 + 50 for j in range(length)]
        for i, length in enumerate((5, 37, 70))
    ]
    prompts.append([*prompts[2][:40], 99, 98, 97])  # shares a cached prefix with the third
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    expected = [hf_greedy(hf, p, 10) for p in prompts]
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=32, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", Prompt(tuple(p)), params)
    outs = run_all(engine)
    engine.add_request("r3", Prompt(tuple(prompts[3])), params)
    outs.update(run_all(engine))
    assert outs["r3"][-1].num_cached_tokens == 32
    for i in range(4):
        assert tokens(outs[f"r{i}"]) == expected[i], f"prompt {i}"
