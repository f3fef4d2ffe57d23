"""Vision inputs of a step: image embeddings from the encoder cache or the vision tower.

Only placeholder rows inside this step's chunk are filled, so an image split across chunks (or
partly covered by a prefix hit) is still merged correctly; the tower runs only for images that
have rows to fill and are not in the encoder cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cachekey.errors import InvalidImageError
from worker.engine.encoder_cache import EncoderCache
from worker.engine.outputs import VisionCounters
from worker.engine.scheduler import ScheduledSeq
from worker.engine.sequence import Sequence
from worker.models.image_processor import ImageProcessor


@dataclass(slots=True)
class _Need:
    row: int  # first row of the flattened batch to fill
    lo: int  # first embedding row of the image
    hi: int  # one past the last embedding row
    identifier: str
    request_id: str
    completes: bool


class VisionInputs:
    def __init__(
        self,
        model: nn.Module,
        processor: ImageProcessor,
        cache: EncoderCache,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.processor = processor
        self.cache = cache
        self.device = device
        self.dtype = dtype
        self.counters = VisionCounters()
        self._pixels: dict[str, dict[str, Tensor]] = {}

    def register(self, seq: Sequence) -> None:
        """Decode the request's images now, so a bad image fails its request, not a step."""
        pixels: dict[str, Tensor] = {}
        for item in seq.mm_items:
            if item.identifier in pixels:
                continue
            data = seq.mm_data.get(item.identifier)
            if data is None:
                raise InvalidImageError(f"no image data for item {item.identifier!r}")
            try:
                pixels[item.identifier] = self.processor.preprocess(data)
            except InvalidImageError as e:  # named by its content part, as the renderer names it
                e.param = e.param or seq.mm_params.get(item.identifier)
                raise
        if pixels:
            self._pixels[seq.request_id] = pixels

    def release(self, request_id: str) -> None:
        self._pixels.pop(request_id, None)

    def has_image_rows(self, batch: list[ScheduledSeq]) -> bool:
        """Whether any scheduled token of the step is an image placeholder."""
        return bool(_needs(batch, [0] * len(batch)))

    def encode_dummy(self, num_images: int) -> Tensor:
        """The vision tower on blank images (memory profiling of a maximum-size step)."""
        size = self.processor.image_size
        pixels = torch.zeros((num_images, 3, size, size), device=self.device, dtype=self.dtype)
        return self.model.encode_images(pixels)

    def step_embeddings(
        self, batch: list[ScheduledSeq], q_starts: list[int], input_ids: Tensor
    ) -> Tensor:
        """Input embeddings of the step, image rows merged by position (never by token id:
        the model may generate the placeholder id itself, and that is just text)."""
        needs = _needs(batch, q_starts)
        if not needs:
            return self.model.embed_tokens(input_ids)
        embeds = self._image_embeddings(needs)
        ids = input_ids.clone()
        for need in needs:
            ids[need.row : need.row + need.hi - need.lo] = 0  # placeholder ids may be off-vocab
        out = self.model.embed_tokens(ids)
        for need in needs:
            rows = embeds[need.identifier][need.lo : need.hi]
            out[need.row : need.row + rows.shape[0]] = rows.to(out.dtype)
            self.counters.images_processed += need.completes
        return out

    def _image_embeddings(self, needs: list[_Need]) -> dict[str, Tensor]:
        embeds: dict[str, Tensor] = {}
        to_encode: dict[str, Tensor] = {}
        for need in needs:
            ident = need.identifier
            if ident in embeds or ident in to_encode:
                continue
            cached = self.cache.get(ident)
            if cached is not None:
                self.counters.encoder_cache_hits += 1
                embeds[ident] = cached
            else:
                to_encode[ident] = self._pixels[need.request_id][ident]
        if to_encode:
            pixels = torch.stack(list(to_encode.values())).to(self.device, self.dtype)
            encoded = self.model.encode_images(pixels)
            self.counters.vision_tower_runs += len(to_encode)
            for ident, emb in zip(to_encode, encoded, strict=True):
                emb = emb.clone()  # do not pin the whole batch output in the cache
                embeds[ident] = emb
                self.cache.put(ident, emb)
        return embeds


def _needs(batch: list[ScheduledSeq], q_starts: list[int]) -> list[_Need]:
    needs: list[_Need] = []
    for item, q_start in zip(batch, q_starts, strict=True):
        seq = item.seq
        start = seq.num_computed_tokens
        end = start + item.num_new_tokens
        for mm in seq.mm_items:
            lo, hi = max(start, mm.offset), min(end, mm.end)
            if lo < hi:
                needs.append(
                    _Need(
                        row=q_start + lo - start,
                        lo=lo - mm.offset,
                        hi=hi - mm.offset,
                        identifier=mm.identifier,
                        request_id=seq.request_id,
                        completes=hi == mm.end,
                    )
                )
    return needs
