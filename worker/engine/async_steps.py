"""--async-scheduling: schedule and launch step N+1 before step N's tokens are read back.

As vLLM v1's async scheduling: while step N runs on the GPU, the host schedules step N+1 (each
row that samples in step N is assumed to gain one token: the scheduler counts it as pending and
gives it a slot), launches it with those rows' input ids gathered from step N's token tensor on
the device, and only then reads step N's tokens back and turns them into outputs. Step N+1 may
carry decode rows, prompt chunks (which need nothing from step N) and newly admitted requests;
a row whose prompt ends in step N takes its first token from step N's tensor like a decode row,
and that token is read back right after step N+1's launch. (docs/worker.md, *Overlapped steps*.)

The engine's outputs, usage, KV event stream, block hashes and counters stay exactly the
synchronous engine's: step N's blocks are cached before step N+1 is scheduled (where the
synchronous step's end caches them), and step N+1 is chained onto step N only where its schedule
cannot depend on which rows step N ends (a stop token or string, an abort). `_chain` refuses
(step N is read back first) when such a row's end would lengthen a prompt chunk the budget cuts
short, or the block it takes could evict or move another's, or a preemption is needed; admission
is `unsure` and stops at the first choice those rows' end could change (Scheduler.held), where
step N is read back, the rows it ended leave step N+1 and `Scheduler.admit_more` goes on; image
rows are read back first too and run synchronously. A row step N surely finishes (max_tokens, the
KV cache's length) is left out of step N+1, as the synchronous engine leaves it out. A row step N
ends all the same has its step N+1 row computed and thrown away: its token is never read, its
block is given back as if never taken (BlockManager.free) and never cached. A caller that reacts
to a token (an abort) does so one step later than with the synchronous engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from worker.engine.outputs import RequestOutput
from worker.engine.scheduler import ScheduledSeq, Scheduler
from worker.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # torch only where the torch runner is
    from worker.engine.token_readback import Feed, SampledTokens


class LaunchingRunner(Protocol):
    overlaps: bool

    def can_launch(self, batch: list[ScheduledSeq]) -> bool: ...

    def launch(
        self, batch: list[ScheduledSeq], feed: Feed | None
    ) -> tuple[list[int], SampledTokens | None]: ...


@dataclass(slots=True)
class InFlight:
    batch: list[ScheduledSeq]
    sampled: list[int]  # the rows of `batch` that sample a token, in `tokens`' order
    tokens: SampledTokens | None  # None: no row samples (prompt chunks only)


class AsyncSteps:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: LaunchingRunner,
        max_seq_len: int,
        on_token: Callable[[Sequence, int], RequestOutput],
        run_sync: Callable[[list[ScheduledSeq]], list[RequestOutput]],
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.max_seq_len = max_seq_len
        self._on_token = on_token
        self._run_sync = run_sync
        self.inflight: InFlight | None = None
        # Steps launched while another was in flight, and those of them with a row that took
        # no token from it: a prompt chunk, an admission (tests and benchmarks read them).
        self.chained = 0
        self.chained_mixed = 0
        # Why a step was not chained: `_chain`'s refusals, "held" (admission waited for the
        # step in flight) and "unlaunchable" (image rows); bench.async_mix prints them.
        self.refused: Counter[str] = Counter()

    def step(self, before_forward: Callable[[], object] | None) -> list[RequestOutput]:
        """LLMEngine.step with a step in flight: the outputs of the step read back in it."""
        prev, self.inflight = self.inflight, None
        sched = self.scheduler
        outputs: list[RequestOutput] = []
        chain = None
        if prev is not None:
            sched.cache_computed(prev.batch)  # where the synchronous step's end caches them
            chain = self._chain()
            if chain is None:  # the next step depends on this one's tokens: read them first
                outputs, prev = self._read(prev), None
        batch = sched.schedule(*chain) if chain is not None else sched.schedule()
        if prev is not None and (sched.held or not self.runner.can_launch(batch)):
            self.refused["held" if sched.held else "unlaunchable"] += 1
            outputs, prev = self._read(prev), None  # what remains to decide depends on it
            batch = [item for item in batch if item.seq.status is SequenceStatus.RUNNING]
            sched.admit_more(batch)
        if before_forward is not None:
            before_forward()
        if not batch:
            return outputs if prev is None else self._read(prev)
        if prev is None and not self.runner.can_launch(batch):
            return outputs + self._run_sync(batch)
        launched = self._launch(batch, prev)
        if prev is not None:
            outputs = self._read(prev)  # while the step just launched runs
        sched.advance(batch)
        self.inflight = launched
        return outputs

    def _launch(self, batch: list[ScheduledSeq], prev: InFlight | None) -> InFlight:
        """Launch `batch`; a row whose input is a token of `prev` takes it on the device."""
        feed = None
        if prev is not None:
            self.chained += 1
            targets = [i for i, item in enumerate(batch) if item.seq.num_pending_tokens]
            if len(targets) < len(batch):
                self.chained_mixed += 1
            if targets and prev.tokens is not None:
                from worker.engine.token_readback import Feed  # the torch runner is loaded

                where = {prev.batch[row].seq: i for i, row in enumerate(prev.sampled)}
                rows = [where[batch[i].seq] for i in targets]
                feed = Feed(prev.tokens.device, targets, rows)
        sampled, tokens = self.runner.launch(batch, feed)
        return InFlight(batch, sampled, tokens)

    def _read(self, step: InFlight) -> list[RequestOutput]:
        """Step's tokens read back and its rows' outputs (as a synchronous step's end); a row
        aborted while it ran is dropped."""
        tokens = step.tokens.tolist() if step.tokens is not None else []
        outputs = []
        for row, token in zip(step.sampled, tokens, strict=True):
            seq = step.batch[row].seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            # Still pending meanwhile: a request this token finishes frees its blocks knowing
            # that a step was launched ahead for it (BlockManager.free).
            outputs.append(self._on_token(seq, token))
            seq.num_pending_tokens = 0
        return outputs

    def _finishes(self, seq: Sequence) -> bool:
        """Does its pending token surely end it (max_tokens, the KV cache's length)?"""
        return (
            seq.num_output_tokens + 1 >= seq.params.max_tokens
            or seq.num_tokens + 1 >= self.max_seq_len
        )

    def _chain(self) -> tuple[set[Sequence], bool] | None:
        """May the running rows of the next step be scheduled before the step in flight is read
        back, as the synchronous engine would schedule them whatever that step's tokens are?
        None if not; else the rows that step surely finishes (left out) and whether it may
        finish others (the admission is then `unsure`: Scheduler.schedule)."""
        sched = self.scheduler
        if not self.runner.overlaps:
            return self._refuse("overlaps")
        bm = sched.block_manager
        budget = sched.max_num_batched_tokens
        finishing: set[Sequence] = set()
        need = 0
        may_stop = cut_short = pending_takes = False
        for seq in sched.running:
            if seq.num_pending_tokens:
                if self._finishes(seq):
                    finishing.add(seq)
                    continue
                may_stop = True
            wanted = seq.num_tokens + seq.num_pending_tokens - seq.num_computed_tokens
            n = min(wanted, budget)
            cut_short = cut_short or n < wanted
            blocks = bm.blocks_needed(seq, n)
            need += blocks
            pending_takes = pending_takes or bool(blocks and seq.num_pending_tokens)
            budget -= n
        if may_stop and cut_short:
            return self._refuse("budget")  # a chunk that rows ending would lengthen
        if need > bm.pool.num_free:
            return self._refuse("preemption")
        if pending_takes and (sched.waiting or not bm.pool.takes_no_cached(need)):
            # A row that may end takes a block: it must evict nothing, move no other's block.
            return self._refuse("eviction" if not sched.waiting else "block_and_waiting")
        if budget == sched.max_num_batched_tokens and not sched.waiting:
            return self._refuse("idle")  # nothing to schedule but the step in flight's
        return finishing, bool(finishing) or may_stop

    def _refuse(self, why: str) -> None:
        self.refused[why] += 1
        return None
