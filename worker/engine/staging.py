"""HostStager: a step's integer inputs reach the device in one host-to-device copy.

Callers pack everything into one int64 numpy array; on CUDA it is written into a persistent
pinned buffer and copied with non_blocking=True (no pageable staging, no per-tensor copies).
Before the buffer is overwritten, the previous step's copy is waited for (an event), since a
step that samples nothing never synchronises. On the CPU the array is used as it is.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class HostStager:
    def __init__(self, device: torch.device, capacity: int = 1 << 14) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host: Tensor | None = None
        self._done: torch.cuda.Event | None = None
        if self._pinned:
            self._grow(capacity)

    def _grow(self, size: int) -> None:
        self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)

    def stage(self, packed: np.ndarray) -> Tensor:
        """packed: int64 [N] -> the same values on the device (a fresh tensor)."""
        if not self._pinned:
            return torch.from_numpy(packed)
        n = packed.shape[0]
        if self._done is not None:
            self._done.synchronize()  # the last copy out of the buffer has finished
        assert self._host is not None
        if n > self._host.shape[0]:
            self._grow(max(n, 2 * self._host.shape[0]))
        host = self._host[:n]
        host.numpy()[:] = packed
        out = host.to(self.device, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()
        return out
