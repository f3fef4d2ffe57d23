"""Sim presets: a step's time as a function of its batch, fitted to figures measured on a device.

A preset is named by the device and model shape its figures were measured on. Its step model:

  step = base                       graph_base for a pure decode step; eager_base once the step
                                    holds any prompt tokens (prefill runs without CUDA graphs)
       + per decode sequence:       per_seq + ctx * its context length
       + per prompt chunk:          token * its new tokens + attn * new tokens * mean context
       + the worker server's own:   server_request + server_stream * streams + server_token *
                                    its uncached prompt tokens, for each request
                                    the step starts (rendering, hashing, SSE: host work that
                                    holds the step's thread), times `server_scale`

The engine coefficients are least-squares fits (in relative error) to `bench.engine`'s figures;
the server's to `bench.ttft` runs whose requests spread evenly over the workers (one worker at
1, 4 and 16 streams; 4 workers under round_robin and least_loaded), each run's seconds per
request on one worker less what the engine fit explains of it, linear in the streams and the
uncached prompt tokens. The last term is the one the engine's own figures do not show: on the
GPU a request whose prompt misses the cache costs the worker's host far more than its prefill
costs the GPU (the docs' workload: about 150 ms a request at a 16-21% hit, against 75-85 ms at
87-94%). `residuals` says how far each fit is from its own figures
(tests/worker/engine/test_sim_presets.py holds them to it; docs/benchmarks.md prints them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import numpy as np

# H200, random-weight llama-1b shape, bfloat16, CUDA graphs, Triton decode, project 99afd2c
# (/work/shared/reference/gpu-figures.md: `bench.engine --device cuda --dtype bfloat16`).
# Decode: (batch, mean context, seconds a step); 128 new tokens after each prompt.
H200_LLAMA_1B_DECODE = (
    (1, 128 + 64, 2.45e-3),
    (8, 128 + 64, 2.81e-3),
    (32, 128 + 64, 3.23e-3),
    (64, 128 + 64, 3.59e-3),
    (16, 2048 + 64, 3.98e-3),
)
# Prefill, one step: (new tokens, cached tokens before them, seconds to the first token).
H200_LLAMA_1B_PREFILL = (
    (2048, 0, 15.1e-3),
    (205, 1843, 13.6e-3),  # 90% hit on 2,048
    (8000, 0, 57.4e-3),
    (800, 7200, 16.5e-3),  # 90% hit on 8,000
)
# The worker server's own cost, from `bench.ttft` runs of 4 workers sharing the one GPU (and one
# worker alone) whose requests spread evenly: (figure, streams per worker, prefix hit, seconds
# per request on one worker = workers / requests/s). Prompts of about 2,600 tokens, 16 out.
H200_LLAMA_1B_SERVER = (
    # One worker: `--workers 1 --num-blocks 2000 --tenants 2 --users-per-tenant 16 --seed 5`.
    ("one worker c1", 1, 0.94, 1 / 12.1),
    ("one worker c4", 4, 0.94, 1 / 11.7),
    ("one worker c16", 16, 0.94, 1 / 10.2),
    # 4 workers, the docs' workload (concurrency 8), second round.
    ("4 workers docs round_robin", 2, 0.210, 4 / 25.6),
    ("4 workers docs least_loaded", 2, 0.163, 4 / 26.4),
    # 4 workers, hot prefixes (concurrency 16), second round.
    ("4 workers hot round_robin", 4, 0.865, 4 / 54.2),
    ("4 workers hot least_loaded", 4, 0.870, 4 / 55.4),
)
# The host KV tier's copy back: pinned host memory to the GPU, (bytes, seconds), measured on the
# same H200 (/work/shared/reference/gpu-figures.md, *Host to device copies*: 32 MB in 0.62 ms,
# 256 MB in 4.88 ms, MB being MiB). The rate is the larger copy's (the bandwidth); the smaller
# one is held to it in tests/worker/engine/test_sim_presets.py.
H200_HOST_TO_DEVICE = ((32 << 20, 0.62e-3), (256 << 20, 4.88e-3))
# The llama-1b shape's K/V per token: 16 layers x (K, V) x 8 KV heads x 64 dims x 2 B (bf16).
LLAMA_1B_KV_BYTES_PER_TOKEN = 16 * 2 * 8 * 64 * 2
PROMPT, OUT, STEP_TOKENS = 2600, 16, 2048


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds; see the module docstring for how they add up."""

    graph_base: float = 0.0
    eager_base: float = 0.0
    per_seq: float = 0.0
    ctx: float = 0.0
    token: float = 0.0
    attn: float = 0.0
    server_request: float = 0.0
    server_stream: float = 0.0
    server_token: float = 0.0
    # The host KV tier: the shape's bytes per token, and host -> device bytes per second.
    kv_bytes_per_token: int = 0
    host_to_device_bytes_per_s: float = 0.0

    def host_load(self, tokens: int) -> float:
        """Seconds to copy `tokens` tokens' K/V back from the host tier (0 without a rate)."""
        if not self.host_to_device_bytes_per_s:
            return 0.0
        return tokens * self.kv_bytes_per_token / self.host_to_device_bytes_per_s

    def decode(self, batch: int, context: float) -> float:
        return self.graph_base + batch * (self.per_seq + self.ctx * context)

    def prefill(self, new: int, cached: int) -> float:
        """One prompt chunk's own time (the step's base is `eager_base`)."""
        return self.token * new + self.attn * new * (cached + new / 2)

    def server(self, streams: int, uncached: int) -> float:
        """The worker server's host time for one request it starts among `streams`, with
        `uncached` prompt tokens to compute."""
        return self.host(streams) + self.server_token * uncached

    def host(self, streams: int) -> float:
        """The server's terms that do not depend on the cache: per request and per stream
        (what `--sim-server-model apart` charges in the API server)."""
        return self.server_request + self.server_stream * streams

    def scaled(self, server_scale: float) -> StepCost:
        return replace(
            self,
            server_request=self.server_request * server_scale,
            server_stream=self.server_stream * server_scale,
            server_token=self.server_token * server_scale,
        )


def _lstsq(rows: list[list[float]], y: list[float], scale: list[float] | None = None) -> np.ndarray:
    """Least squares in relative error (each row over `scale`, by default its own figure): a
    2 ms step and a 57 ms step are held to the same share."""
    w = 1 / np.array(scale if scale is not None else y)
    coef, *_ = np.linalg.lstsq(np.array(rows) * w[:, None], np.array(y) * w, rcond=None)
    return coef


def capacity_seconds(c: StepCost, streams: int, hit: float) -> float:
    """Steady-state seconds per request of one worker kept at `streams` streams, each prompt
    `PROMPT` tokens with a `hit` share cached: its prompt steps' extra over decode steps, its
    share of the decode steps, and its server cost (the closed-form mean of what the sim does
    step by step)."""
    cached = int(PROMPT * hit)
    new = PROMPT - cached
    chunks = -(-new // STEP_TOKENS)
    prompt_extra = chunks * (c.eager_base - c.graph_base) + c.prefill(new, cached)
    decode_share = OUT * c.decode(streams, PROMPT + OUT / 2) / streams
    return prompt_extra + decode_share + c.server(streams, new)


def fit(decode=H200_LLAMA_1B_DECODE, prefill=H200_LLAMA_1B_PREFILL, server=H200_LLAMA_1B_SERVER):
    """The step model's coefficients from the figures (engine first, then the server)."""
    graph_base, per_seq, ctx = _lstsq(
        [[1, b, b * t] for b, t, _ in decode], [s for *_, s in decode]
    )
    eager_base, token, attn = _lstsq(
        [[1, n, n * (k + n / 2)] for n, k, _ in prefill], [s for *_, s in prefill]
    )
    engine = StepCost(*(float(x) for x in (graph_base, eager_base, per_seq, ctx, token, attn)))
    # Server: what the engine does not explain of each per-request time, linear in the streams
    # and the uncached tokens.
    rest = [s - capacity_seconds(engine, n, hit) for _, n, hit, s in server]
    rows = [[1, n, PROMPT - int(PROMPT * hit)] for _, n, hit, _ in server]
    coef = _lstsq(rows, rest, [s for *_, s in server])
    names = ("server_request", "server_stream", "server_token")
    return replace(engine, **{k: max(float(v), 0.0) for k, v in zip(names, coef, strict=True)})


def residuals(c: StepCost) -> list[tuple[str, float, float]]:
    """(figure, measured, the model's) for every figure the preset was fitted to."""
    out = [(f"decode b{b} ctx{t}", s, c.decode(b, t)) for b, t, s in H200_LLAMA_1B_DECODE]
    out += [
        (f"prefill {n} after {k}", s, c.eager_base + c.prefill(n, k))
        for n, k, s in H200_LLAMA_1B_PREFILL
    ]
    out += [
        (f"{name} s/request", s, capacity_seconds(c, n, hit))
        for name, n, hit, s in H200_LLAMA_1B_SERVER
    ]
    return out


@cache
def presets() -> dict[str, StepCost]:
    nbytes, seconds = H200_HOST_TO_DEVICE[-1]
    h200 = replace(
        fit(),
        kv_bytes_per_token=LLAMA_1B_KV_BYTES_PER_TOKEN,
        host_to_device_bytes_per_s=nbytes / seconds,
    )
    return {"h200-llama-1b": h200}


def preset(name: str, server_scale: float = 1.0) -> StepCost:
    """The named preset, its server cost scaled (0: a worker with no host cost of its own)."""
    table = presets()
    if name not in table:
        raise ValueError(f"unknown sim preset {name!r}; known: {', '.join(sorted(table))}")
    return table[name].scaled(server_scale)


def main() -> None:
    """`python -m worker.engine.sim_presets`: each preset's coefficients and residuals."""
    for name, c in presets().items():
        print(f"{name}: {c}")
        print(f"{'figure':40} {'measured':>10} {'model':>10} {'error':>7}")
        for figure, measured, model in residuals(c):
            error = (model - measured) / measured
            print(f"{figure:40} {measured * 1e3:8.2f}ms {model * 1e3:8.2f}ms {error:+7.1%}")


if __name__ == "__main__":
    main()
