"""One simulated replica's GPU: the worker's real block manager under a timing model, no steps.

A replica prefills one request at a time, first come first served, for `step_s` plus
`prefill_s_per_token` per uncached prompt token (a GPU's prefill throughput); then the request
decodes for `decode_s_per_step` per output token alongside the others (a decode batch costs one
step whatever its size). Each stage is one timer on the event loop, so a replica costs nothing
while it waits and a request costs a few callbacks, not one per engine step.

The prefix cache is the kvgate worker's own `BlockManager` (paged blocks, LRU free queue,
reverse-order freeing, the token equality guard, `clamp_match`), so caching, eviction and the
`BlockStored` / `BlockRemoved` / `AllBlocksCleared` events are the worker's. The match is taken
when a request's prefill starts, after every earlier request's prefill has cached its blocks:
a request never recomputes a prefix another one is computing (`defers_shared_prefill`).
Output tokens are not keyed: only prompt blocks are cached.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cachekey.events import KVEvent
from worker.engine.block_manager import BlockManager, cdiv
from worker.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Timing:
    prefill_s_per_token: float = 0.0002  # uncached prompt tokens: 5,000 tokens/s per replica
    decode_s_per_step: float = 0.002  # one output token of every decoding request
    step_s: float = 0.002  # the floor of a prefill: at least one engine step

    def __post_init__(self) -> None:
        if min(self.prefill_s_per_token, self.decode_s_per_step, self.step_s) < 0:
            raise ValueError("sim timings must be >= 0")


@dataclass(slots=True, eq=False)
class Job:
    """One request on one replica. `on_first_token(cached_tokens)` runs when its prefill ends,
    `on_done()` when its last token is out."""

    seq: Sequence
    max_tokens: int
    on_first_token: Callable[[int], None]
    on_done: Callable[[], None]
    cached_tokens: int = 0


@dataclass(slots=True)
class EngineCounters:
    """What /metrics reports (vLLM's names in harness/fleet/replica.py)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    prefill_seconds: float = 0.0  # admission to first token, summed
    computed_tokens: int = 0  # prompt tokens prefilled (cache hits excluded), summed
    requests: int = 0


class SimEngine:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        timing: Timing,
        publish: Callable[[list[KVEvent]], None],
    ) -> None:
        # Text only: the multimodal match rule never applies; "clamp" is WorkerInfo's default too.
        self.bm = BlockManager(
            num_blocks, block_size, enable_prefix_caching=True, mm_match_rule="clamp"
        )
        self.block_size = block_size
        self.timing = timing
        self._publish = publish
        self._queue: deque[Job] = deque()
        self._prefilling: Job | None = None
        self.decoding = 0
        self.counters = EngineCounters()

    @property
    def running(self) -> int:
        return self.decoding + (self._prefilling is not None)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def fits(self, seq: Sequence, max_tokens: int) -> bool:
        """Whether the request fits the whole KV cache at all (else it could never run)."""
        return cdiv(seq.num_prompt_tokens + max_tokens, self.block_size) <= self.bm.num_blocks

    def submit(self, job: Job) -> None:
        self._queue.append(job)
        self._next()

    def reset(self) -> bool:
        """Drop every cached block (refused while a request holds blocks, as vLLM does)."""
        done = self.bm.reset()
        self._flush()
        return done

    def _flush(self) -> None:
        events = self.bm.drain_events()
        if events:
            self._publish(events)

    def _next(self) -> None:
        """Start the next prefill, if none runs and the head of the queue has room."""
        if self._prefilling is not None or not self._queue:
            return
        job = self._queue[0]
        seq = job.seq
        hits = self.bm.find_cached_prefix(seq)
        new_tokens = seq.num_prompt_tokens + job.max_tokens - len(hits) * self.block_size
        if not self.bm.can_allocate(seq, hits, new_tokens):
            return  # blocks held by decoding requests: retried when one finishes
        self._queue.popleft()
        self.bm.allocate(seq, hits, new_tokens)
        self._flush()  # evictions leave now, before the blocks they made room for
        job.cached_tokens = cached = len(hits) * self.block_size
        t = self.timing
        duration = t.step_s + (seq.num_prompt_tokens - cached) * t.prefill_s_per_token
        c = self.counters
        c.requests += 1
        c.prompt_tokens += seq.num_prompt_tokens
        c.cached_tokens += cached
        c.computed_tokens += seq.num_prompt_tokens - cached
        c.prefill_seconds += duration
        self._prefilling = job
        asyncio.get_running_loop().call_later(duration, self._prefilled, job)

    def _prefilled(self, job: Job) -> None:
        seq = job.seq
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.bm.cache_full_blocks(seq)
        self._flush()
        self._prefilling = None
        self.decoding += 1
        job.on_first_token(job.cached_tokens)
        decode = max(job.max_tokens - 1, 0) * self.timing.decode_s_per_step
        asyncio.get_running_loop().call_later(decode, self._finished, job)
        self._next()

    def _finished(self, job: Job) -> None:
        self.bm.free(job.seq)
        self.decoding -= 1
        self.counters.generation_tokens += job.max_tokens
        job.on_done()
        self._next()
