"""Decode with LoRA: a batch mixing adapters against the base model's decode, in one run.

One engine with LoRA enabled (`--max-loras` slots of rank `--rank`) serves batches of
`--batch` requests: all on the base model, or spread over `--adapters` adapters (rank `--rank`,
every attention and MLP projection, generated with random weights). Rounds alternate the two so
both see the same host; each figure is the median over `--reps` rounds of decode tokens/s
(prefill not counted). A LoRA-disabled engine's base decode is the reference that shows what
enabling LoRA costs when no request uses it.

    .venv/bin/python -m bench.lora_decode                   # the demo model, float32, 1 thread
    .venv/bin/python -m bench.lora_decode --model llama-1b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from bench import engine_reference as ref
from bench.engine import Clock, decode_rate, resolve_model
from bench.report import write_json
from cachekey import Prompt
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.lora_adapter import BaseShapes
from worker.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "lora_decode.json"


def write_adapter(model_dir: Path, out: Path, seed: int, rank: int) -> Path:
    """A PEFT-layout adapter of every projection of the model at model_dir, random weights."""
    config = json.loads((model_dir / "config.json").read_text())
    base = BaseShapes.from_config(config)
    prefix = "language_model.model." if "text_config" in config else "model."
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(base.num_layers):
        for proj, (in_f, out_f) in base.shapes.items():
            block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.{prefix}layers.{layer}.{block}.{proj}"
            weights[f"{key}.lora_A.weight"] = rng.standard_normal((rank, in_f), np.float32) * 0.02
            weights[f"{key}.lora_B.weight"] = rng.standard_normal((out_f, rank), np.float32) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    save_file(weights, str(out / "adapter_model.safetensors"))
    return out


def mixed_decode_rate(
    engine: LLMEngine, clock: Clock, tag: str, names: list[str], args: argparse.Namespace
) -> float:
    """decode_rate with request i on adapter names[i % len(names)]."""
    rng = random.Random(tag)
    vocab = engine.runner.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for i in range(args.batch):
        ids = tuple(ref.random_ids(rng, args.prompt_len, vocab))
        engine.add_request(f"{tag}-{i}", Prompt(ids), params, lora_name=names[i % len(names)])
    produced = 0
    while produced < args.batch:
        produced += len(engine.step())
    start = clock()
    decoded = 0
    while engine.has_unfinished_requests():
        decoded += len(engine.step())
    return decoded / (clock() - start)


def make_engine(model: str, args: argparse.Namespace, modules: tuple[str, ...]) -> LLMEngine:
    lora = {"max_loras": args.adapters, "max_lora_rank": args.rank} if modules else {}
    return LLMEngine(
        EngineConfig(
            model=model,
            device=args.device,
            dtype=args.dtype,
            num_blocks=args.num_blocks,
            max_num_seqs=args.batch,
            lora_modules=modules,
            **lora,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo", help="a directory, demo, or a bench shape")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/kvgate-bench-models"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, _ = resolve_model(args.model, args.models_dir, device)
    root = args.models_dir / f"lora-{Path(model).name}-r{args.rank}"
    names = [f"adapter-{i}" for i in range(args.adapters)]
    modules = tuple(
        f"{n}={write_adapter(Path(model), root / n, seed=i, rank=args.rank)}"
        for i, n in enumerate(names)
    )
    clock = Clock(args.clock, device)
    plain = make_engine(model, args, ())
    lora = make_engine(model, args, modules)
    vocab = lora.runner.vocab_size
    base = lambda eng, tag: decode_rate(  # noqa: E731
        eng, clock, tag, args.batch, args.prompt_len, args.new_tokens, vocab
    )
    (
        base(plain, "warm-plain"),
        base(lora, "warm-base"),
        mixed_decode_rate(lora, clock, "w", names, args),
    )
    rates: dict[str, list[float]] = {"lora_off_base": [], "lora_on_base": [], "lora_on_mixed": []}
    for r in range(args.reps):  # alternate, so every figure sees the same host
        rates["lora_off_base"].append(base(plain, f"p{r}"))
        rates["lora_on_base"].append(base(lora, f"b{r}"))
        rates["lora_on_mixed"].append(mixed_decode_rate(lora, clock, f"m{r}", names, args))
    medians = {k: statistics.median(v) for k, v in rates.items()}
    ratio = medians["lora_on_mixed"] / medians["lora_on_base"]
    for k, v in medians.items():
        print(f"{k:>15}: {v:8.0f} tok/s")
    print(f"{args.adapters} adapters mixed / base, same engine: {ratio:.2f}x")
    write_json(
        args.out,
        {
            "args": {k: str(v) for k, v in vars(args).items()},
            "tok_s": medians,
            "mixed_over_base": round(ratio, 3),
            "rounds": rates,
        },
    )


if __name__ == "__main__":
    main()
