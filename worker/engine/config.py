"""EngineConfig: every engine knob, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from cachekey.keys import DEFAULT_HASH_SEED, MMMatchRule
from kvgate_cli.flags import format_size, option, parse_size
from worker.engine.sim_presets import preset

_ENGINES = ("torch", "sim")
SIM_SERVER_MODELS = ("step", "apart", "thread")
_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_MM_MATCH_RULES: tuple[str, ...] = get_args(MMMatchRule)
DECODE_BACKENDS = ("auto", "reference", "triton")
# worker.models.elementwise.ELEMENTWISE_BACKENDS (not imported: this module stays torch-free).
ELEMENTWISE_BACKENDS = ("auto", "reference", "triton")

# On CPU the KV cache gets a fixed, modest budget: the host runs other things too.
CPU_KV_CACHE_BYTES = 256 * 1024 * 1024
# The sim engine has no tensors; without num_blocks it pretends to have this many.
SIM_DEFAULT_NUM_BLOCKS = 8192


_SIZE = {"parse": parse_size, "show": format_size, "metavar": "BYTES"}


@dataclass(slots=True)
class EngineConfig:
    model: str = option(
        help="Hugging Face-format model directory, or demo: the tiny LLaVA-style model, "
        "generated into ~/.cache/kvgate (or $KVGATE_CACHE_DIR) on first use",
        metavar="PATH|demo",
    )
    served_model_name: str | None = option(
        None,
        "the model clients send; also part of the hash namespace",
        default_text="the model directory's name (demo for the demo model)",
    )
    engine: str = option(
        "torch",
        "sim keeps the real scheduler and block manager but replaces the forward pass with "
        "a timing model",
        choices=_ENGINES,
    )
    device: str = option("auto", "where the torch engine runs", choices=_DEVICES)
    dtype: str = option("auto", "precision of the torch engine", choices=_DTYPES)
    block_size: int = option(16, "tokens per KV block")
    num_blocks: int | None = option(
        None,
        "KV blocks; small values force evictions",
        default_text=f"from --kv-cache-memory-bytes (sim: {SIM_DEFAULT_NUM_BLOCKS})",
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        "KV-cache memory when --num-blocks is not given",
        default_text=f"{format_size(CPU_KV_CACHE_BYTES)} on CPU; on CUDA what "
        "--gpu-memory-utilization leaves after the weights and a profiled step",
        **_SIZE,
    )
    kv_offload_bytes: int = option(
        0,
        "a host-memory KV tier of this size (0: off): evicted blocks are copied there (pinned "
        "memory on CUDA) and a prefix hit in it is copied back instead of recomputed",
        **_SIZE,
    )
    kv_offload_blocks: int | None = option(
        None,
        "the host KV tier in blocks instead of bytes (the sim engine without --sim-preset "
        "knows no bytes per block)",
    )
    gpu_memory_utilization: float = option(
        0.9,
        "CUDA: this engine's share of the GPU's memory (weights, the activation peak of a "
        "profiled maximum-size step and the KV cache); the KV cache gets what is left",
    )
    enforce_eager: bool = option(False, "CUDA: run decode eagerly instead of CUDA graphs")
    async_scheduling: bool = option(
        False,
        "schedule and launch each step (decode rows, prompt chunks, admissions) while the one "
        "before it runs, reading its tokens back afterwards (vLLM's async scheduling; the torch "
        "engine); results are those of the synchronous engine",
    )
    decode_attention: str = option(
        "auto",
        "decode attention kernel: auto is triton on CUDA and the portable reference elsewhere",
        choices=DECODE_BACKENDS,
    )
    elementwise_kernels: str = option(
        "auto",
        "RMSNorm + residual add, rotary and SwiGLU: auto is fused Triton kernels on CUDA and "
        "the torch reference elsewhere",
        choices=ELEMENTWISE_BACKENDS,
    )
    max_num_seqs: int = option(32, "requests in the running batch at most")
    max_num_batched_tokens: int = option(2048, "tokens per engine step at most")
    max_model_len: int | None = option(
        None,
        "longest prompt + completion; longer prompts get HTTP 400",
        default_text="the model's",
    )
    enable_prefix_caching: bool = option(
        True,
        "disable the prefix cache (no BlockStored events then)",
        name="--no-prefix-caching",
    )
    hash_seed: str = option(
        DEFAULT_HASH_SEED, "hash namespace seed (the gateway reads it from /kvgate/info)"
    )
    encoder_cache_bytes: int = option(
        64 * 1024 * 1024, "memory for cached image embeddings; 0 disables the cache", **_SIZE
    )
    mm_match_rule: str = option(
        "partial",
        "a prefix-cache hit that ends inside an image: partial reuses its blocks (the rest of "
        "the image's rows come from the encoder cache or the vision tower, as in vLLM); clamp "
        "rewinds it to the block holding the image's start (LMDeploy's rule)",
        choices=_MM_MATCH_RULES,
    )
    enable_lora: bool = option(
        False, "serve LoRA adapters (implied by --lora-modules); docs/worker.md, LoRA adapters"
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "LoRA adapters to serve from the start, each name=path to a PEFT adapter directory "
        '(or vLLM\'s {"name": ..., "path": ...}); several, comma-separated or repeated',
        metavar="NAME=PATH",
    )
    max_loras: int = option(1, "LoRA adapters in device slots at once (distinct per batch)")
    max_lora_rank: int = option(16, "largest LoRA rank accepted; every slot is this wide")
    hidden_state_cache: bool = option(
        False,
        "keep every cached token's final hidden state next to its K/V (same blocks, eviction "
        "and memory budget), so mean-pooled embeddings and return_hidden_states use prefix hits",
    )
    hidden_state_layers: tuple[int, ...] = option(
        (),
        "also keep the hidden states entering these decoder layers (Hugging Face hidden_states "
        "indices, 0 = the input embeddings); implies --hidden-state-cache",
        metavar="N[,N]",
    )
    sim_prefill_s_per_token: float = option(
        0.0, "the sim engine's seconds per prompt token it computes (cache misses)"
    )
    sim_decode_s_per_step: float = option(0.0, "the sim engine's seconds per engine step")
    sim_preset: str | None = option(
        None,
        "the sim engine's step times from figures measured on a device (worker/engine/"
        "sim_presets.py: h200-llama-1b); replaces --sim-prefill-s-per-token and "
        "--sim-decode-s-per-step",
        metavar="NAME",
    )
    sim_server_scale: float = option(
        1.0,
        "with --sim-preset: the share of the measured worker server's own cost per request "
        "it charges (0: a worker with none)",
    )
    sim_server_model: str = option(
        "step",
        "with --sim-preset: where the worker server's own cost goes. step: all of it in the "
        "engine step that starts a request (the worker of the preset's figures, its host work "
        "holding the engine's thread); apart: its per-request and per-stream terms in the API "
        "server, one request at a time, before the request reaches the engine (the engine core "
        "a process of its own), holding its event loop, its per-uncached-token term in the "
        "step; thread: as apart, in one thread beside the event loop, which goes on reading "
        "requests and streaming meanwhile (as rendering off the loop would)",
        choices=SIM_SERVER_MODELS,
    )
    sim_time_scale: float = option(
        1.0,
        "multiply every sim step's time by this (2: the fleet runs at half speed): on a busy "
        "host the sleeps then outweigh the processes' own CPU time, which the model leaves out",
    )

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model (a model directory) is required")
        if self.served_model_name is None:
            self.served_model_name = Path(self.model).name or str(self.model)
        _choice("engine", self.engine, _ENGINES)
        _choice("device", self.device, _DEVICES)
        _choice("dtype", self.dtype, _DTYPES)
        _choice("decode_attention", self.decode_attention, DECODE_BACKENDS)
        _choice("sim_server_model", self.sim_server_model, SIM_SERVER_MODELS)
        _choice("elementwise_kernels", self.elementwise_kernels, ELEMENTWISE_BACKENDS)
        _choice("mm_match_rule", self.mm_match_rule, _MM_MATCH_RULES)
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
        if self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {self.kv_offload_bytes}")
        if self.kv_offload_blocks is not None:
            _positive("kv_offload_blocks", self.kv_offload_blocks)
        if self.host_tier_on and not self.enable_prefix_caching:
            raise ValueError("the host KV tier (--kv-offload-bytes) needs prefix caching")
        if self.encoder_cache_bytes < 0:
            raise ValueError(f"encoder_cache_bytes must be >= 0, got {self.encoder_cache_bytes}")
        if self.sim_prefill_s_per_token < 0 or self.sim_decode_s_per_step < 0:
            raise ValueError("sim timings must be >= 0")
        if self.sim_server_scale < 0:
            raise ValueError(f"sim_server_scale must be >= 0, got {self.sim_server_scale}")
        if self.sim_time_scale <= 0:
            raise ValueError(f"sim_time_scale must be > 0, got {self.sim_time_scale}")
        if self.sim_preset is not None:
            preset(self.sim_preset)  # an unknown name fails here, with the known ones
        self.hidden_state_layers = _layers(self.hidden_state_layers)
        if self.hidden_state_layers:
            self.hidden_state_cache = True
        if not self.hash_seed:
            raise ValueError("hash_seed must be a non-empty string")
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        self.lora_modules = tuple(self.lora_modules)
        for module in self.lora_modules:
            parse_lora_module(module)
        if self.lora_modules:
            self.enable_lora = True

    @property
    def host_tier_on(self) -> bool:
        return self.kv_offload_blocks is not None or self.kv_offload_bytes > 0

    def lora_module_paths(self) -> list[tuple[str, str]]:
        """(name, path) of each --lora-modules entry."""
        return [parse_lora_module(m) for m in self.lora_modules]


_LORA_JSON_FIELDS = {"name", "path", "base_model_name"}


def parse_lora_module(entry: str) -> tuple[str, str]:
    """(name, path) of one --lora-modules entry, in either of vLLM's forms: `name=path`, or a
    JSON object with `name` and `path` (and `base_model_name`, which a worker of one base model
    has no use for)."""
    if entry.lstrip().startswith("{"):
        try:
            obj = json.loads(entry)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: not a JSON object ({e.msg}): {entry!r}") from None
        if not isinstance(obj, dict) or set(obj) - _LORA_JSON_FIELDS:
            extra = sorted(set(obj) - _LORA_JSON_FIELDS) if isinstance(obj, dict) else obj
            raise ValueError(f"--lora-modules: unknown fields {extra} in {entry!r}")
        name, path = obj.get("name"), obj.get("path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ValueError(f"--lora-modules: JSON needs string `name` and `path`: {entry!r}")
        return name.strip(), path.strip()
    name, sep, path = entry.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(
            f'--lora-modules takes name=path or {{"name": ..., "path": ...}}, got {entry!r}'
        )
    return name.strip(), path.strip()


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _layers(values: tuple) -> tuple[int, ...]:
    """Layer indices from ints or the flag's strings: sorted, unique, non-negative."""
    try:
        layers = sorted({int(v) for v in values})
    except (TypeError, ValueError):
        raise ValueError(f"hidden_state_layers must be integers, got {values!r}") from None
    if layers and layers[0] < 0:
        raise ValueError(f"hidden_state_layers must be >= 0, got {layers[0]}")
    return tuple(layers)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
