"""DecodeRunner: steps in which every sequence computes one token, through fixed input buffers.

The inputs of a decode step (token ids, positions, cache slots, context lengths, block tables) live
in buffers allocated once for max_num_seqs rows. Each step packs them on the host, sends them in
one copy and scatters them into the buffers' first rows on the device. With CUDA graphs, the batch
is padded up to a size bucket and the graph captured for that bucket at start-up is replayed:
nothing is planned or launched per shape in the step loop. Padding rows write their K/V to a
spare block that no sequence owns and attend over one token of it. Without graphs (the CPU, or
`enforce_eager`) the same buffers run the model eagerly on exactly the live rows, and the block
tables are cut to the longest row so the portable kernel gathers no more than it needs. With LoRA,
each row's adapter slot is one more static input (-1 for the base model and padding); the graphs
select every row's adapter from it, and an eager step with no adapter row skips LoRA.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from worker.engine.decode_attention import DecodeKernel
from worker.engine.paged_attention import DecodeContext
from worker.engine.scheduler import ScheduledSeq
from worker.engine.staging import HostStager
from worker.engine.token_readback import Feed
from worker.models.lora import LoRAModel

_IDS, _POS, _SLOTS, _LENS, _LORA = range(5)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a captured graph: 1, 2, 4, 8, then every multiple of 8 up to the max."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: Tensor,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        kernel: DecodeKernel,
        stager: HostStager,
        pad_block: int,
        use_graphs: bool,
        lora: LoRAModel | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.kernel = kernel
        self.stager = stager
        self.pad_block = pad_block
        self.device = kv_cache.device
        self.lora = lora
        self.max_pages = -(-max_model_len // block_size)
        self.small = torch.zeros((5, max_num_seqs), dtype=torch.long, device=self.device)
        self.tables = torch.zeros(
            (max_num_seqs, self.max_pages), dtype=torch.long, device=self.device
        )
        # Host-side images of the buffers, filled in place each step.
        self._host_small = np.zeros((5, max_num_seqs), dtype=np.int64)
        self._host_tables = np.zeros((max_num_seqs, self.max_pages), dtype=np.int64)
        self._pad_column = np.array([[0], [0], [pad_block * block_size], [1], [-1]], np.int64)
        self.buckets = batch_buckets(max_num_seqs) if use_graphs else []
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    def bucket(self, n: int) -> int:
        """Rows the step runs with: the smallest bucket holding n, or n itself without graphs."""
        for size in self.buckets:
            if size >= n:
                return size
        return n

    def stage(
        self, batch: list[ScheduledSeq], rows: int, feed: Feed | None = None
    ) -> tuple[int, bool]:
        """Fill the first `rows` rows of the buffers (padding past the batch); returns the widest
        block table of the step and whether a row has a LoRA adapter. Table entries past a row's
        own length are stale: never read. With a feed, a row whose input id is the previous
        step's token, still on the device (token_readback.py), gathers it there."""
        n, bs = len(batch), self.block_size
        small, tables = self._host_small, self._host_tables
        small[:, n:rows] = self._pad_column
        tables[n:rows, 0] = self.pad_block
        width = 1
        adapted = False
        for i, item in enumerate(batch):
            seq = item.seq
            pos = seq.num_computed_tokens
            table = seq.block_table
            pages = pos // bs + 1
            slot = table[pos // bs] * bs + pos % bs
            token = seq.token_ids[pos] if pos < len(seq.token_ids) else 0  # 0: fed
            small[:, i] = (token, pos, slot, pos + 1, item.lora_slot)
            adapted = adapted or item.lora_slot >= 0
            tables[i, :pages] = table[:pages]
            width = max(width, pages)
        parts = [small[:, :rows].ravel(), tables[:rows, :width].ravel()]
        if feed is not None:  # every row fed (a decode step after one): its rows alone
            index = feed.rows if len(feed.targets) == n else [*feed.targets, *feed.rows]
            parts.append(np.asarray(index, dtype=np.int64))
        staged = self.stager.stage(np.concatenate(parts))
        n_small, n_tables = small.shape[0] * rows, rows * width
        self.small[:, :rows].copy_(staged[:n_small].view(-1, rows))
        self.tables[:rows, :width].copy_(staged[n_small : n_small + n_tables].view(rows, width))
        if feed is not None:
            self._gather_ids(feed, n, staged[n_small + n_tables :])
        return width, adapted

    def _gather_ids(self, feed: Feed, n: int, index: Tensor) -> None:
        """The fed rows' input ids, from the previous step's tokens on the device."""
        if len(feed.targets) == n:
            self.small[_IDS, :n].copy_(feed.tokens[index])
        else:
            targets, sources = index.view(2, -1)
            self.small[_IDS].index_copy_(0, targets, feed.tokens[sources])

    def _forward(self, rows: int, width: int, adapted: bool) -> Tensor:
        ctx = DecodeContext.build(
            self.kv_cache,
            self.small[_SLOTS, :rows],
            self.tables[:rows, :width],
            self.small[_LENS, :rows],
            self.kernel,
        )
        ids = self.small[_IDS, :rows]
        if self.lora is not None:
            if adapted:
                self.lora.batch.prepare(self.small[_LORA, :rows])
            else:
                self.lora.batch.clear()
        embeds = self.model.embed_tokens(ids)  # decode tokens are text, images or not
        return self.model(ids, self.small[_POS, :rows], ctx, embeds)

    def run(self, batch: list[ScheduledSeq], feed: Feed | None = None) -> Tensor:
        """Hidden states [len(batch), hidden] of the step's tokens."""
        n = len(batch)
        rows = self.bucket(n)
        width, adapted = self.stage(batch, rows, feed)
        graph = self._graphs.get(rows)
        if graph is None:
            return self._forward(rows, width, adapted)[:n]
        graph[0].replay()
        return graph[1][:n]

    def capture(self) -> None:
        """Capture one CUDA graph per bucket, largest first, all sharing one memory pool."""
        pool = None
        lora = self.lora is not None  # captured with LoRA: any step's rows may have adapters
        for rows in reversed(self.buckets):
            self.stage([], rows)  # every row is padding: valid inputs for the warm-up
            self._forward(rows, self.max_pages, lora)  # compiles kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(rows, self.max_pages, lora)
            pool = graph.pool()
            self._graphs[rows] = (graph, out)
        torch.cuda.synchronize(self.device)
