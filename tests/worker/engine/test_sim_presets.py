"""Sim presets: each one reproduces the figures it was fitted to, and the sim engine charges its
step model (the batch's decodes and prompts, the worker server's cost per request it starts)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.engine import run_all
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.engine.sim_presets import (
    H200_HOST_TO_DEVICE,
    capacity_seconds,
    preset,
    presets,
    residuals,
)

# How far the fit may be from each kind of figure (relative): the engine's figures are smooth in
# the batch; the one-worker runs are not (per-request time 82.6, 85.5, 98.0 ms at 1, 4, 16
# streams, where the engine alone would fall with the streams).
BOUNDS = {"decode": 0.06, "prefill": 0.13, "one worker": 0.20, "4 workers": 0.06}


@pytest.mark.parametrize("name", sorted(presets()))
def test_preset_reproduces_its_own_figures(name: str) -> None:
    rows = residuals(presets()[name])
    assert len(rows) == 16
    for figure, measured, model in rows:
        bound = next(b for kind, b in BOUNDS.items() if figure.startswith(kind))
        assert abs(model - measured) <= bound * measured, (figure, measured, model)


def test_host_tier_copy_back_is_the_measured_rate() -> None:
    """The copy back from the host tier: both measured copies within 3% of the preset's rate,
    and 8,000 tokens of the llama-1b shape (the issue's 256 MB) in about 4.9 ms."""
    c = preset("h200-llama-1b")
    assert c.kv_bytes_per_token == 32768
    for nbytes, seconds in H200_HOST_TO_DEVICE:
        tokens = nbytes // c.kv_bytes_per_token
        assert abs(c.host_load(tokens) - seconds) <= 0.03 * seconds, (nbytes, seconds)
    assert 4.6e-3 < c.host_load(8000) < 4.9e-3
    assert c.host_load(8000) < 0.1 * (c.eager_base + c.prefill(8000, 0))  # vs its 57 ms prefill


def test_preset_shape_is_the_gpu_s() -> None:
    c = preset("h200-llama-1b")
    # A step grows slowly with the batch: 64 decodes take well under 2x one decode's step.
    assert c.decode(1, 192) < c.decode(64, 192) < 1.6 * c.decode(1, 192)
    # A prompt step pays the eager base: a 90%-hit prompt still costs most of a cold one.
    assert c.eager_base + c.prefill(205, 1843) > 0.6 * (c.eager_base + c.prefill(2048, 0))
    # The server's own cost dominates a worker's capacity, grows with its streams, and a prompt
    # that misses the cache costs it far more than its prefill costs the GPU.
    assert c.server(16, 156) > 0.5 * capacity_seconds(c, 16, 0.94)
    assert c.server(16, 156) > c.server(1, 156) > 0
    assert c.server(2, 2000) - c.server(2, 200) > 5 * (c.prefill(2000, 600) - c.prefill(200, 2400))
    none = preset("h200-llama-1b", server_scale=0.0)
    assert none.server(16, 2000) == 0.0 and none.decode(8, 192) == c.decode(8, 192)


def test_unknown_preset_is_refused(demo_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="h200-llama-1b"):
        EngineConfig(model=str(demo_model_dir), engine="sim", sim_preset="tpu-v9")
    with pytest.raises(ValueError, match="sim_server_scale"):
        EngineConfig(model=str(demo_model_dir), engine="sim", sim_server_scale=-1.0)


def timed_burst(
    model_dir: Path, scale: float, n: int, time_scale: float = 1.0, server_model: str = "step"
) -> tuple[float, float]:
    """`n` requests added at once to a preset sim engine: (seconds of the first step, seconds of
    a later pure-decode step)."""
    config = EngineConfig(
        model=str(model_dir),
        engine="sim",
        sim_preset="h200-llama-1b",
        sim_server_scale=scale,
        sim_time_scale=time_scale,
        sim_server_model=server_model,
    )
    engine = LLMEngine(config)
    for i in range(n):  # distinct prompts: all admitted in the first step
        prompt = engine.renderer.render_completion(f"Prompt {i} of the burst. " * 20)
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.step()
    decode = time.perf_counter() - t0
    run_all(engine)
    return first, decode


def test_sim_engine_charges_the_preset(demo_model_dir: Path) -> None:
    c = preset("h200-llama-1b")
    first, decode = timed_burst(demo_model_dir, 1.0, 4)
    # Four requests start in the first step: four times the server's cost among four streams.
    assert first >= c.eager_base + 4 * c.server(4, 0)
    assert decode >= c.decode(4, 0) and decode < first / 10
    bare_first, _ = timed_burst(demo_model_dir, 0.0, 4)
    assert c.eager_base <= bare_first < c.eager_base + c.server(4, 0)


@pytest.mark.parametrize("model", ["apart", "thread"])
def test_apart_leaves_the_step_only_the_uncached_tokens_term(
    demo_model_dir: Path, model: str
) -> None:
    """`--sim-server-model apart` (or `thread`): the API server pays the per-request and
    per-stream terms (tests/worker/server/test_sim_server_model.py), so the step that starts
    four requests pays only their uncached tokens' term on top of the engine's own time."""
    c = preset("h200-llama-1b")
    first, _ = timed_burst(demo_model_dir, 1.0, 4)
    apart, _ = timed_burst(demo_model_dir, 1.0, 4, server_model=model)
    assert apart >= c.eager_base and apart < first - 3 * c.host(4)


def test_sim_time_scale_slows_every_step_alike(demo_model_dir: Path) -> None:
    c = preset("h200-llama-1b", server_scale=0.0)
    first, decode = timed_burst(demo_model_dir, 0.0, 2, time_scale=4.0)
    assert first >= 4 * c.eager_base and decode >= 4 * c.decode(2, 0)
