"""HiddenStateCache: the hidden states of every computed token, kept in the KV cache's slots.

Layout: [rows, (num_blocks + 1) * block_size, hidden_size], one row per kept layer in Hugging
Face's `hidden_states` numbering (i < num_layers: what enters decoder layer i, 0 being the input
embeddings; the last row is always the final, normed output). A token's hidden states live at the
same slot as its K/V (`block_id * block_size + offset`), so the cache mirrors the KV cache block
for block with no bookkeeping of its own: a cached block's hidden states are valid exactly as
long as its K/V are, and evicting, reusing or resetting a block does the same to both.

Storage is always on once configured: every step writes the hidden states of all the tokens it
computes (prefills, chunks and decodes, eager or inside a CUDA graph) at the step's slot mapping.
The writes are forward hooks on the model's layers, registered only when the cache exists, so
neither the model code nor the step loop changes; without the cache nothing runs at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from worker.engine.input_batch import slots_of

# Tokens per device-to-host copy when reading: bounds the device memory a long read needs.
READ_CHUNK_TOKENS = 4096


def text_decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (embed_tokens, layers, norm) of a Llama or LLaVA model."""
    lm = getattr(model, "language_model", model)
    return lm.model


def bytes_per_token(hidden_size: int, num_rows: int, dtype: torch.dtype) -> int:
    return num_rows * hidden_size * torch.empty((), dtype=dtype).element_size()


class HiddenStateCache:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hidden_size: int,
        layers: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers = tuple(layers)  # kept besides the final output, ascending
        self.block_size = block_size
        self.cache = torch.zeros(
            (len(self.layers) + 1, num_blocks * block_size, hidden_size), dtype=dtype, device=device
        )
        # Each row's Hugging Face hidden_states index (the final one is num_layers), on attach.
        self.row_layers: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    def attach(self, model: nn.Module) -> None:
        """Hook the writes into `model`: the chosen layers' inputs and the decoder's output."""
        decoder = text_decoder(model)
        num_layers = len(decoder.layers)
        for layer in self.layers:
            if not 0 <= layer < num_layers:
                raise ValueError(
                    f"hidden-state layer {layer} outside the model's 0..{num_layers - 1}"
                )
        for row, layer in enumerate(self.layers):
            decoder.layers[layer].register_forward_pre_hook(self._pre_hook(row), with_kwargs=True)
        decoder.register_forward_hook(self._post_hook(len(self.layers)), with_kwargs=True)
        self.row_layers = (*self.layers, num_layers)

    def _pre_hook(self, row: int) -> Callable:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = _hidden_states(args, kwargs)
            self.cache[row].index_copy_(0, _slot_mapping(args, kwargs), hidden.to(self.cache.dtype))

        return hook

    def _post_hook(self, row: int) -> Callable:
        def hook(_module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> None:
            self.cache[row].index_copy_(0, _slot_mapping(args, kwargs), output.to(self.cache.dtype))

        return hook

    def read(self, block_table: list[int], num_tokens: int, final_only: bool = False) -> np.ndarray:
        """Positions 0..num_tokens-1 of a sequence with this block table, as float32
        [rows, num_tokens, hidden] (or [num_tokens, hidden] with final_only)."""
        cache = self.cache[-1:] if final_only else self.cache
        slots = slots_of(block_table, 0, num_tokens, self.block_size)
        out = np.empty((cache.shape[0], num_tokens, cache.shape[2]), dtype=np.float32)
        index = torch.from_numpy(slots).to(cache.device)
        for start in range(0, num_tokens, READ_CHUNK_TOKENS):
            part = index[start : start + READ_CHUNK_TOKENS]
            rows = cache.index_select(1, part).float().cpu().numpy()
            out[:, start : start + len(part)] = rows
        return out[0] if final_only else out


# The hooks find what they need by kind, not position, so they do not depend on the signatures:
# the step's slot mapping on the attention context (the argument with a `slot_mapping`), and
# the hidden states a layer is called with (its floating-point 2-D argument).


def _slot_mapping(args: tuple, kwargs: dict) -> Tensor:
    for value in (*args, *kwargs.values()):
        slots = getattr(value, "slot_mapping", None)
        if slots is not None:
            return slots
    raise RuntimeError("hidden-state hook: the call carries no attention context")


def _hidden_states(args: tuple, kwargs: dict) -> Tensor:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor) and value.is_floating_point() and value.dim() == 2:
            return value
    raise RuntimeError("hidden-state hook: the call carries no hidden states")
