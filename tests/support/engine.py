"""Helpers shared by the engine tests (no tests here)."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

from torch import Tensor

from cachekey import Prompt
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine, RequestOutput
from worker.engine.model_runner import ModelRunner
from worker.engine.sampler import Sampler
from worker.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class LogitsRecorder:
    """The engine's own sampler, keeping every logits row each request sampled from, in order."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.logits: dict[str, list[Tensor]] = {}

    def sample(self, logits: Tensor, requests: list[tuple[str, SamplingParams]]) -> list[int]:
        return self.sample_tensor(logits, requests).tolist()

    def sample_tensor(self, logits: Tensor, requests: list[tuple[str, SamplingParams]]) -> Tensor:
        for row, (request_id, _) in enumerate(requests):
            self.logits.setdefault(request_id, []).append(logits[row].float().cpu())
        return self.sampler.sample_tensor(logits, requests)

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)


def make_engine(model_dir: Path, **overrides: object) -> LLMEngine:
    """A small CPU engine; a torch one records its logits (`sampled_logits`)."""
    settings: dict[str, object] = {"dtype": "float32", "device": "cpu", "num_blocks": 256}
    settings.update(overrides)
    engine = LLMEngine(EngineConfig(model=str(model_dir), **settings))  # type: ignore[arg-type]
    if isinstance(engine.runner, ModelRunner):
        engine.runner.sampler = LogitsRecorder(engine.runner.sampler)  # type: ignore[assignment]
    return engine


def sampled_logits(engine: LLMEngine, request_id: str) -> list[Tensor]:
    """The logits rows `request_id` sampled from on a `make_engine` torch engine, in order."""
    recorder = engine.runner.sampler  # type: ignore[union-attr]
    assert isinstance(recorder, LogitsRecorder)
    return recorder.logits[request_id]


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def generate(
    engine: LLMEngine, request_id: str, prompt: Prompt, params: SamplingParams = GREEDY
) -> list[RequestOutput]:
    engine.add_request(request_id, prompt, params)
    return run_all(engine)[request_id]


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def png_bytes(seed: int, size: int = 48) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.new("RGB", (size, size))
    img.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256))] * (size * size))
    for _ in range(200):
        img.putpixel((rng.randrange(size), rng.randrange(size)), (rng.randrange(256),) * 3)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def image_chat(engine: LLMEngine, text_before: str, image: bytes, text_after: str) -> Prompt:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [
        {"type": "text", "text": text_before},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": text_after},
    ]
    return engine.renderer.render_chat([{"role": "user", "content": content}])
