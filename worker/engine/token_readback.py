"""A launched step's sampled tokens: on the device for the next step, on their way to the host.

With --async-scheduling (docs/worker.md, *Overlapped steps*) the engine launches step N+1 before
it reads step N's tokens. Step N+1's input ids come from step N's token tensor on the device
(`Feed`: a gather in the stream, no host round trip), and step N's tokens reach the host by a
non-blocking copy into pinned memory, queued right after step N's sampling, with an event to
wait on: the wait ends when step N is done, while step N+1 keeps the GPU busy. Two pinned
buffers alternate, since at most one launched step is unread when the next is launched. On the
CPU every launch has finished when it returns, and the tensor is its own read-back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class SampledTokens:
    device: Tensor  # [B] int64, one token per row of the step
    host: Tensor  # its copy in pinned memory (CUDA), or `device` itself (CPU)
    done: torch.cuda.Event | None  # recorded after the copy (CUDA)

    def tolist(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


@dataclass(slots=True)
class Feed:
    """Step N+1's input ids from step N: row `targets[i]` of the step (its one new token) takes
    `tokens[rows[i]]`; the other rows' ids are known on the host (prompt chunks)."""

    tokens: Tensor
    targets: list[int]
    rows: list[int]


class TokenReadback:
    def __init__(self, device: torch.device, max_rows: int) -> None:
        self._buffers: list[Tensor] = []
        if device.type == "cuda":
            self._buffers = [
                torch.empty(max_rows, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
        self._turn = 0

    def start(self, tokens: Tensor) -> SampledTokens:
        if not self._buffers:
            return SampledTokens(tokens, tokens, None)
        host = self._buffers[self._turn][: tokens.shape[0]]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return SampledTokens(tokens, host, done)
