"""The engine with the fused elementwise kernels gives the greedy tokens of the torch reference:
on CUDA compiled, on the CPU in Triton's interpreter (the whole engine, the kernels interpreted)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton wheels exist for Linux x86_64 only")

from cachekey import Prompt
from tests.support.engine import make_engine, run_all, sampled_logits, tokens
from tests.support.paths import REPO
from worker.engine.config import EngineConfig
from worker.engine.sampling_params import SamplingParams
from worker.models.layers import GatedActivation, RMSNorm
from worker.models.rotary import RotaryEmbedding

# Prompt lengths: with 16-token steps the 23-token prompt is chunked and the steps mix prefill
# chunks with decodes, as well as pure decode steps (DecodeRunner). Few tokens: the interpreter
# runs each kernel program in Python.
PROMPT_LENS = (5, 23, 11)
NEW_TOKENS = 6


def _fused_modules(engine) -> int:
    """Modules of the engine's model that run a fused kernel."""
    fusable = (RMSNorm, RotaryEmbedding, GatedActivation)
    modules = engine.runner.model.modules()
    return sum(isinstance(m, fusable) and m.kernels is not None for m in modules)


def greedy_runs(model_dir: str, device: str = "cpu") -> dict:
    """Per elementwise backend: what the model runs, its fused modules and each request's
    greedy tokens; and the largest difference between the two's logits, row by row."""
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 1000) for _ in range(n)] for n in PROMPT_LENS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs, logits = {}, {}
    for backend in ("reference", "triton"):
        engine = make_engine(
            Path(model_dir), device=device, elementwise_kernels=backend, max_num_batched_tokens=16
        )
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", Prompt(tuple(prompt)), params)
        outputs = run_all(engine)
        runs[backend] = {
            "elementwise": engine.runner.model.elementwise,
            "fused_modules": _fused_modules(engine),
            "tokens": {rid: tokens(outs) for rid, outs in sorted(outputs.items())},
        }
        logits[backend] = torch.stack(
            [row for rid in sorted(outputs) for row in sampled_logits(engine, rid)]
        )
    diff = (logits["triton"] - logits["reference"]).abs().max().item()
    return {
        "runs": runs,
        "max_logit_diff": diff,
        "logit_scale": logits["reference"].abs().max().item(),
    }


def test_fused_kernels_give_the_reference_greedy_tokens(demo_model_dir: Path) -> None:
    if torch.cuda.is_available():
        result = greedy_runs(str(demo_model_dir), "cuda")
    else:
        # TRITON_INTERPRET must be set before triton is first imported: a fresh process.
        code = (
            "import json, sys; import tests.worker.engine.test_fused_engine as t;"
            " print(json.dumps(t.greedy_runs(sys.argv[1])))"
        )
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-c", code, str(demo_model_dir)],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    reference, fused = result["runs"]["reference"], result["runs"]["triton"]
    assert reference["elementwise"] == "reference" and reference["fused_modules"] == 0
    # The demo's text model: 2 layers x 2 norms, the final norm, rotary, 2 SwiGLUs.
    assert fused["elementwise"] == "triton" and fused["fused_modules"] == 8
    assert all(len(t) == NEW_TOKENS for t in reference["tokens"].values())
    assert fused["tokens"] == reference["tokens"]
    assert result["max_logit_diff"] <= 1e-4 * max(1.0, result["logit_scale"]), result


def test_config_rejects_an_unknown_elementwise_backend() -> None:
    with pytest.raises(ValueError, match="elementwise_kernels must be one of"):
        EngineConfig(model="demo", elementwise_kernels="fused")
