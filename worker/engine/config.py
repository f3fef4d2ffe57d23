"""EngineConfig: every engine knob, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_ENGINES = ("torch", "sim")
_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
DECODE_BACKENDS = ("auto", "reference", "triton")

# On CPU the KV cache gets a fixed, modest budget: the host runs other things too.
CPU_KV_CACHE_BYTES = 256 * 1024 * 1024
# The sim engine has no tensors; without num_blocks it pretends to have this many.
SIM_DEFAULT_NUM_BLOCKS = 8192


@dataclass(slots=True)
class EngineConfig:
    model: str
    served_model_name: str | None = None
    engine: str = "torch"
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    # CUDA: the fraction of the GPU's memory this engine may use in all (weights, the activation
    # peak of a profiled maximum-size step, the KV cache); the KV cache gets the rest.
    gpu_memory_utilization: float = 0.9
    # CUDA: run decode steps eagerly instead of replaying captured CUDA graphs.
    enforce_eager: bool = False
    # Decode attention kernel: auto (triton on CUDA, reference elsewhere), reference, triton.
    decode_attention: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    hash_seed: str = "kvgate-v1"
    encoder_cache_bytes: int = 64 * 1024 * 1024
    sim_prefill_s_per_token: float = 0.0
    sim_decode_s_per_step: float = 0.0

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model (a model directory) is required")
        if self.served_model_name is None:
            self.served_model_name = Path(self.model).name or str(self.model)
        _choice("engine", self.engine, _ENGINES)
        _choice("device", self.device, _DEVICES)
        _choice("dtype", self.dtype, _DTYPES)
        _choice("decode_attention", self.decode_attention, DECODE_BACKENDS)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.encoder_cache_bytes < 0:
            raise ValueError(f"encoder_cache_bytes must be >= 0, got {self.encoder_cache_bytes}")
        if self.sim_prefill_s_per_token < 0 or self.sim_decode_s_per_step < 0:
            raise ValueError("sim timings must be >= 0")
        if not self.hash_seed:
            raise ValueError("hash_seed must be a non-empty string")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
