"""A tiny transformers Llama and PEFT adapters saved by PEFT itself, for the LoRA tests."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import peft
import torch
import transformers

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_tiny_llama(path: Path, demo_model_dir: Path, hidden_size: int = 64) -> Path:
    """A random GQA Llama (float32) with the demo tokenizer."""
    config = transformers.LlamaConfig(
        vocab_size=2000,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, path / name)
    return path


def write_peft_adapter(base_dir: Path, out: Path, seed: int, **lora: object) -> Path:
    """A LoRA adapter of the model at base_dir, saved by PEFT; A and B both random (non-zero)."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    config = peft.LoraConfig(init_lora_weights=False, **lora)  # type: ignore[arg-type]
    with warnings.catch_warnings():  # an lm_head target makes PEFT say it saves embeddings too
        warnings.simplefilter("ignore", UserWarning)
        peft.get_peft_model(model, config).save_pretrained(out)
    return out


def hf_model(base_dir: Path, adapter_dir: Path | None = None) -> torch.nn.Module:
    """transformers' model of base_dir, with PEFT's adapter applied when given."""
    model = transformers.LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
