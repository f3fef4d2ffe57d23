"""HostKVCopier: the torch engine's bytes for the host KV tier (host_tier.py keeps the books).

The device tensors a block owns (its K/V in every layer, and its rows of the hidden-state cache
when there is one) are each viewed as [A, num_blocks + 1, B], the block in the middle; a host
slot holds each of them as one contiguous [A, B] row of a host buffer [slots, A, B], so every
copy between a slot and the device is one contiguous memcpy.

On CUDA the host buffers are pinned and every copy runs on a side stream, after the work the
step's stream has queued (the block's K/V is complete) and before the next step's forward,
which waits for the side stream (`wait`): a reused block is not overwritten before its copy out
has read it, and a loaded block is not read before its copy in has landed. On the CPU the
streams are absent and the same code copies synchronously (the tested path). The loads' time
is vLLM's `vllm:kv_offload_load_time`: the plain copies' on the CPU, CUDA events' on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor


class HostKVCopier:
    def __init__(self, planes: list[Tensor], num_slots: int, device: torch.device) -> None:
        self.planes = planes  # each [A, num_blocks + 1, B] on the device
        self.device = device
        self.num_slots = num_slots
        pin = device.type == "cuda"
        self.host = [
            torch.empty((num_slots, p.shape[0], p.shape[2]), dtype=p.dtype, pin_memory=pin)
            for p in planes
        ]
        self.stream = torch.cuda.Stream(device) if pin else None
        self.block_bytes = block_bytes(planes)
        self._load_seconds = 0.0
        # CUDA: each load's (start, end) events on the side stream, until they have completed.
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def save(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device block, host slot) each: device -> host."""
        if not pairs:
            return
        with self._side():
            ids = torch.tensor([b for b, _ in pairs], device=self.device)
            for plane, host in zip(self.planes, self.host, strict=True):
                staged = plane.index_select(1, ids).transpose(0, 1).contiguous()  # [n, A, B]
                for j, (_, slot) in enumerate(pairs):
                    host[slot].copy_(staged[j], non_blocking=True)

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host slot, device block) each: host -> device."""
        if not pairs:
            return
        with self._side(), self._timed():
            ids = torch.tensor([b for _, b in pairs], device=self.device)
            for plane, host in zip(self.planes, self.host, strict=True):
                shape = (len(pairs), *host.shape[1:])
                staged = torch.empty(shape, dtype=host.dtype, device=self.device)
                for j, (slot, _) in enumerate(pairs):
                    staged[j].copy_(host[slot], non_blocking=True)
                plane.index_copy_(1, ids, staged.transpose(0, 1))

    @property
    def load_seconds(self) -> float:
        """Seconds the loads took: on the CPU each plain copy's; on CUDA the side stream's time
        between each load's events, counted once the load has completed (none is waited for)."""
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.pop(0)
            self._load_seconds += start.elapsed_time(end) / 1000.0
        return self._load_seconds

    @contextmanager
    def _timed(self) -> Iterator[None]:
        if self.stream is None:
            t0 = time.perf_counter()
            yield
            self._load_seconds += time.perf_counter() - t0
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # on the side stream: `_timed` runs inside `_side`
        yield
        end.record()
        self._timing.append((start, end))

    def wait(self) -> None:
        """The step's stream waits for every copy queued so far (a no-op on the CPU)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    @contextmanager
    def _side(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield


def block_planes(kv_cache: Tensor, hidden_cache: Tensor | None, num_blocks: int) -> list[Tensor]:
    """Views of what a block owns, [A, num_blocks, B] each: the K/V cache [layers, 2, blocks,
    block_size, heads, dim], and the hidden-state cache [rows, blocks * block_size, hidden]."""
    layers, kv = kv_cache.shape[:2]
    planes = [kv_cache.view(layers * kv, num_blocks, -1)]
    if hidden_cache is not None:
        planes.append(hidden_cache.view(hidden_cache.shape[0], num_blocks, -1))
    return planes


def block_bytes(planes: list[Tensor]) -> int:
    return sum(p.shape[0] * p.shape[2] * p.element_size() for p in planes)
