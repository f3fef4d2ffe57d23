"""KV cache sizing from a profiled step, as vLLM's profile_run does.

The runner runs one step of the largest size the scheduler can produce (max_num_batched_tokens
tokens, sampling max_num_seqs rows) before the KV cache exists and measures the memory that step
needed on top of the weights. The KV cache then gets what is left of
`gpu_memory_utilization * total` after what this engine took since it started (weights, allocator
slack) and that activation peak. As in vLLM, the fraction is this engine's share of the device:
other processes' memory does not count against it, but the engine refuses to start when less than
its share is free (so several workers can share one GPU with a fraction each).

On CUDA the peak comes from the caching allocator's statistics. Elsewhere `LiveTensorBytes`
counts the storages that the step's tensor ops create and frees as they die: the same real step,
measured without a device allocator (kernel-internal scratch is not visible to it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages allocated by ops run under this mode and still alive.

    Storages an op reads that were not allocated under the mode (weights, caches, inputs) are
    foreign: views of them and in-place results are not new memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._owned: set[int] = set()
        self._foreign: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._note_foreign(t.untyped_storage())
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._note_new(t.untyped_storage())
        return out

    def _note_foreign(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key in self._owned or key in self._foreign:
            return
        self._foreign.add(key)
        weakref.finalize(storage, self._foreign.discard, key)

    def _note_new(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        size = storage.nbytes()
        if size == 0 or key in self._owned or key in self._foreign:
            return
        self._owned.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        self._owned.discard(key)
        self.live -= size


def step_peak_bytes(run_step: Callable[[], object], device: torch.device) -> int:
    """Memory a step needs beyond what is allocated before it (its activation peak)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run_step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with LiveTensorBytes() as meter:
        result = run_step()
        del result
    return meter.peak


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    total: int  # device memory
    in_use: int  # taken by this engine since it started: weights, allocator slack
    activation_peak: int  # the profiled step's need on top of that
    utilization: float  # the fraction of `total` this engine may use

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.total * self.utilization) - self.in_use - self.activation_peak


def cuda_free_at_start(device: torch.device, utilization: float) -> int:
    """Free device memory before the engine loads anything; raises if its share is not free."""
    free, total = torch.cuda.mem_get_info(device)
    if free < utilization * total:
        raise ValueError(
            f"gpu_memory_utilization {utilization} asks for {utilization * total / 2**30:.1f} GiB "
            f"but only {free / 2**30:.1f} GiB of the GPU are free; lower it"
        )
    return free


def cuda_budget(
    device: torch.device, free_at_start: int, activation_peak: int, utilization: float
) -> MemoryBudget:
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryBudget(total, free_at_start - free, activation_peak, utilization)


def num_kv_blocks(budget: MemoryBudget, bytes_per_block: int) -> int:
    kv_bytes = budget.kv_cache_bytes
    if kv_bytes < bytes_per_block:
        raise ValueError(
            f"no memory left for the KV cache: {budget.utilization:.2f} of {budget.total} B, "
            f"minus {budget.in_use} B of weights and a {budget.activation_peak} B step peak, "
            f"leaves {kv_bytes} B (one block needs {bytes_per_block} B); raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return kv_bytes // bytes_per_block
