"""Sampler: greedy, temperature, top-k, top-p; a torch.Generator per seeded request."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from worker.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._seeded: dict[str, torch.Generator] = {}
        # Unseeded requests share one generator, itself seeded from the OS.
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    def forget(self, request_id: str) -> None:
        self._seeded.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._seeded.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._seeded[request_id] = gen
        return gen

    def sample(self, logits: Tensor, requests: list[tuple[str, SamplingParams]]) -> list[int]:
        """logits: [B, vocab] for B requests (id, params) -> one token id each."""
        return self.sample_tensor(logits, requests).tolist()

    def sample_tensor(self, logits: Tensor, requests: list[tuple[str, SamplingParams]]) -> Tensor:
        """The same tokens as a [B] tensor on the device, with no wait for the host: every
        generator draws exactly as `sample` does."""
        out = logits.argmax(dim=-1)
        for row, (request_id, params) in enumerate(requests):
            if params.greedy:
                continue
            probs = _filtered_probs(logits[row].float(), params)
            gen = self._generator(request_id, params)
            out[row : row + 1] = torch.multinomial(probs, 1, generator=gen)
        return out


def _filtered_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p. The top token always
        # stays: a top_p below float32's range (1e-300) rounds to 0 here and would drop every
        # token, NaN probabilities that killed the engine loop.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)
