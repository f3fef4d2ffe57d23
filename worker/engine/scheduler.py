"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Every step gives each running sequence what it still needs (one token for a decode, the rest
of a prompt chunk for a prefill) under a token budget, then admits waiting sequences, oldest
first. A waiting sequence whose next prefix block a running sequence is still computing waits
until that block is cached, then hits it: two requests sharing a prefix never compute it twice,
and the hit a gateway predicts for the second one is the whole shared prefix (docs/worker.md).
A request's cached prefix becomes the newest in the LRU when it arrives, so the work admitted
ahead of it does not evict it first. A waiting sequence whose LoRA adapter can get no slot (all
`max_loras` are in use) is passed over until one frees. Either way the ones behind it go ahead,
and it keeps its place in the queue.
When blocks run out, the most recently admitted running sequence is preempted: its blocks are
freed, its generated tokens kept, and it is recomputed later (mostly from the prefix cache), so
its output is unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from worker.engine.block_manager import BlockManager, Hit, host_hits
from worker.engine.lora_manager import NO_SLOT, LoRAManager
from worker.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    lora_slot: int = NO_SLOT  # the LoRA slot its tokens use; NO_SLOT: the base model

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token is computed, so the next token can be sampled."""
        seq = self.seq
        return (
            seq.num_computed_tokens + self.num_new_tokens == seq.num_tokens + seq.num_pending_tokens
        )


@dataclass(slots=True)
class SchedulerCounters:
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0  # found on the GPU
    host_hits_tokens: int = 0  # found in the host tier (copied back, not computed)
    num_preemptions: int = 0


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        loras: LoRAManager | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.loras = loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self.held = False  # the last `schedule` held admission back (`admit_more`)

    def add(self, seq: Sequence) -> None:
        self.block_manager.refresh_cached_prefix(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(
        self,
        finishing: set[Sequence] | frozenset[Sequence] = frozenset(),
        unsure: bool = False,
    ) -> list[ScheduledSeq]:
        """`finishing`: running sequences the step in flight surely finishes (--async-scheduling),
        left out as if they had finished already. `unsure`: that step may finish others too, so
        admission stops before any choice their end could change (`held`, `admit_more`)."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        self.held = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq in finishing:
                continue  # preempted earlier in this loop, or on its way out
            n = min(seq.num_tokens + seq.num_pending_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, n):
                preempted = True
                continue
            self.block_manager.append_slots(seq, n)
            scheduled.append(ScheduledSeq(seq, n, self._lora_slot(seq)))
            budget -= n
        if not preempted:
            self.held = self._admit(scheduled, budget, unsure)
        return scheduled

    def admit_more(self, scheduled: list[ScheduledSeq]) -> None:
        """Go on with an admission `schedule` held back, once the step in flight is read back
        and `scheduled` has lost the rows it finished: as the synchronous engine admits."""
        if self.held:
            self.held = False
            budget = self.max_num_batched_tokens - sum(item.num_new_tokens for item in scheduled)
            self._admit(scheduled, budget)

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Preempt from the back of `running` until seq can grow; False if seq itself went."""
        while not self.block_manager.can_append_slots(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, scheduled: list[ScheduledSeq], budget: int, unsure: bool = False) -> bool:
        """Admit waiting sequences, oldest first. `unsure`: admit only while nothing the step in
        flight may free (budget, seats, blocks, LoRA slots) could change the choice; True when
        it stopped there with requests still waiting."""
        bm = self.block_manager
        # Passed over (no LoRA slot, or a running sequence computes their prefix): they keep
        # their places in the queue.
        passed: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = bm.find_cached_prefix(seq) if self._lora_ready(seq) else None
            if hits is None or self._computing(seq, len(hits)):
                if unsure:
                    return True
                passed.append(self.waiting.popleft())
                continue
            wanted = seq.num_tokens - len(hits) * bm.block_size
            n = min(wanted, budget)
            if unsure and n < wanted:
                return True
            if not bm.can_allocate(seq, hits, n):
                break
            self.waiting.popleft()
            self._start(seq, hits, n)
            scheduled.append(ScheduledSeq(seq, n, self._lora_slot(seq)))
            budget -= n
        self.waiting.extendleft(reversed(passed))
        return unsure and bool(self.waiting)

    def _start(self, seq: Sequence, hits: list[Hit], n: int) -> None:
        bm = self.block_manager
        bm.allocate(seq, hits, n)
        if seq.num_cached_tokens is None:
            num_hit_tokens = len(hits) * bm.block_size
            seq.num_cached_tokens = num_hit_tokens
            from_host = len(host_hits(hits)) * bm.block_size
            seq.num_host_cached_tokens = from_host
            self.counters.prefix_queries_tokens += seq.num_tokens
            self.counters.prefix_hits_tokens += num_hit_tokens - from_host
            self.counters.host_hits_tokens += from_host
        seq.status = SequenceStatus.RUNNING
        seq.scheduled_at = time.monotonic()
        self.running.append(seq)
        if self.loras is not None and seq.lora_name is not None:
            self.loras.acquire(seq.request_id)

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

    def _lora_ready(self, seq: Sequence) -> bool:
        if self.loras is None or seq.lora_name is None:
            return True
        return self.loras.can_acquire(seq.request_id)

    def _lora_slot(self, seq: Sequence) -> int:
        if self.loras is None or seq.lora_name is None:
            return NO_SLOT
        return self.loras.slot_index(seq.request_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_lora(seq)
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

    def advance(self, batch: list[ScheduledSeq]) -> None:
        """A launched step (--async-scheduling): its tokens count as computed for the next
        schedule, and the token sampled for each row that completes its prompt is pending
        until the read-back. A row that finished meanwhile is left alone."""
        for item in batch:
            seq = item.seq
            if seq.status is SequenceStatus.RUNNING:
                samples = item.completes_prompt  # (before its tokens count as computed)
                seq.num_computed_tokens += item.num_new_tokens
                seq.num_pending_tokens = int(samples)

    def cache_computed(self, batch: list[ScheduledSeq]) -> None:
        """The launched step's blocks, cached before the next step is scheduled (as `update`
        does after a synchronous step): every token they hold is known by then. A request
        aborted since the launch caches none, as the synchronous engine never ran its step."""
        for item in batch:
            if item.seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(item.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release_lora(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release_lora(self, seq: Sequence) -> None:
        if self.loras is not None and seq.lora_name is not None:
            self.loras.release(seq.request_id)
