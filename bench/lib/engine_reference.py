"""The yardsticks of the engine benchmark, measured in the same run on the same device:
Hugging Face transformers on the same weights, and the device's floors (copy bandwidth, matmul
rate) from which the batch-1 decode floor and the prefill floor follow."""

from __future__ import annotations

import inspect
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], object], reps: int) -> float:
    """Median seconds of fn() over reps calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s moved by a device-to-device copy (read + write)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / timed(device, lambda: y.copy_(x), 10)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n x n matmul."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / timed(device, lambda: a @ a, 10)


def floors(device: torch.device, dtype: torch.dtype, params: int, prefill_tokens: int) -> dict:
    big = device.type == "cuda"
    bw = copy_bandwidth(device, (1 << 30) if big else (1 << 26))
    flops = matmul_rate(device, dtype, 8192 if big else 1024)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return {
        "copy_bytes_per_s": bw,
        "matmul_flop_per_s": flops,
        # Batch-1 decode reads every weight once per token; a copy moves each byte twice.
        "decode_b1_tok_s": (bw / 2) / (itemsize * params),
        f"prefill_{prefill_tokens}_ms": 2 * params * prefill_tokens / flops * 1e3,
    }


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def transformers_figures(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    prompt_lens: list[int],
    decode_cases: list[tuple[int, int]],
    new_tokens: int,
    reps: int,
    report: Callable[[str, float], None],
) -> None:
    """TTFT (one forward, last logits only) and decode tokens/s (generate, SDPA, dynamic cache)."""
    import transformers

    # transformers 5 renamed torch_dtype to dtype.
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", **{dtype_kw: dtype}
    )
    model = model.to(device).eval()
    vocab = model.config.vocab_size
    params = inspect.signature(model.forward).parameters
    # Only the last position's logits, as the engine computes (named so since transformers 4.50).
    last_only = {"logits_to_keep" if "logits_to_keep" in params else "num_logits_to_keep": 1}
    rng = random.Random(1)
    with torch.inference_mode():
        for n in prompt_lens:
            ids = torch.tensor([random_ids(rng, n, vocab)], device=device)
            seconds = timed(device, lambda ids=ids: model(ids, **last_only), reps)
            report(f"hf_ttft_{n}_ms", seconds * 1e3)
        for batch, plen in decode_cases:
            ids = torch.tensor([random_ids(rng, plen, vocab) for _ in range(batch)], device=device)
            mask = torch.ones_like(ids)

            def decode_seconds(ids=ids, mask=mask) -> float:
                stamps = _TokenStamps(device)
                model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                    streamer=stamps,
                )
                return stamps.decode_seconds()

            decode_seconds()  # warm-up
            seconds = statistics.median(decode_seconds() for _ in range(reps))
            report(f"hf_decode_b{batch}_ctx{plen}_tok_s", batch * (new_tokens - 1) / seconds)


class _TokenStamps:
    """A generate() streamer that notes when each token is out: the decode steps are timed
    inside one generation, from the first new token to the last. (Timing generate(1) and
    generate(n) apart and subtracting can go negative on a busy machine.)"""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:  # the prompt first, then each new token
        synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_seconds(self) -> float:
        return self.times[-1] - self.times[1]
