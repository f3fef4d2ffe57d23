"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Every step gives each running sequence what it still needs (one token for a decode, the rest
of a prompt chunk for a prefill) under a token budget, then admits waiting sequences, oldest
first. A waiting sequence whose next prefix block a running sequence is still computing waits
until that block is cached, then hits it: two requests sharing a prefix never compute it twice,
and the hit a gateway predicts for the second one is the whole shared prefix (docs/worker.md).
A request's cached prefix becomes the newest in the LRU when it arrives, so the work admitted
ahead of it does not evict it first.
When blocks run out, the most recently admitted running sequence is preempted: its blocks are
freed, its generated tokens kept, and it is recomputed later (mostly from the prefix cache), so
its output is unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from worker.engine.block_manager import BlockManager
from worker.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token is computed, so the next token can be sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerCounters:
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    num_preemptions: int = 0


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()

    def add(self, seq: Sequence) -> None:
        self.block_manager.refresh_cached_prefix(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, n):
                preempted = True
                continue
            self.block_manager.append_slots(seq, n)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        if not preempted:
            budget = self._admit(scheduled, budget)
        return scheduled

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Preempt from the back of `running` until seq can grow; False if seq itself went."""
        while not self.block_manager.can_append_slots(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        bm = self.block_manager
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = bm.find_cached_prefix(seq)
            if self._computing(seq, len(hits)):
                deferred.append(self.waiting.popleft())  # keeps its place in the queue
                continue
            num_hit_tokens = len(hits) * bm.block_size
            n = min(seq.num_tokens - num_hit_tokens, budget)
            if not bm.can_allocate(seq, hits, n):
                break
            self.waiting.popleft()
            bm.allocate(seq, hits, n)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_hit_tokens
                self.counters.prefix_queries_tokens += seq.num_tokens
                self.counters.prefix_hits_tokens += num_hit_tokens
            seq.status = SequenceStatus.RUNNING
            seq.scheduled_at = time.monotonic()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _computing(self, seq: Sequence, num_hits: int) -> bool:
        """Is a running sequence computing block `num_hits` of seq's prefix (not cached yet)?

        Keys chain their parents, so equal keys at one index mean equal prefixes up to it.
        """
        if not self.block_manager.enable_prefix_caching or num_hits >= len(seq.block_keys):
            return False
        key = seq.block_keys[num_hits]
        for other in self.running:
            if (
                other.num_cached_blocks <= num_hits < len(other.block_keys)
                and other.block_keys[num_hits] == key
            ):
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.counters.num_preemptions += 1

    def update(self, batch: list[ScheduledSeq]) -> None:
        """Account the step's computed tokens and cache the blocks they completed."""
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
