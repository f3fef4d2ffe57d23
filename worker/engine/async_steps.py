"""--async-scheduling: schedule and launch step N+1 before step N's tokens are read back.

As vLLM v1's async scheduling: while step N runs on the GPU, the host schedules step N+1
(each running row is assumed to gain one token: the scheduler counts it as pending and gives
it a slot), launches it with its input ids gathered from step N's token tensor on the device,
and only then reads step N's tokens back and turns them into outputs. The GPU never waits for
the host's step in between. (docs/worker.md, *Overlapped steps*.)

Only decode steps are launched ahead (ModelRunner.can_launch); any other step runs
synchronously, after the step in flight is read back. A launched step N+1 is chained onto the
step in flight only when nothing it schedules can depend on step N's tokens, so that the
engine's outputs, usage, KV events, block hashes and counters are exactly the synchronous
engine's (`_chain`): no request waiting for admission, every row decoding, the token budget
holds them all, and the blocks their pending tokens need are free and cached nowhere (so taking
them evicts nothing and preempts nobody). A row that step N surely finishes (max_tokens, the KV
cache's length) is left out of step N+1, as the synchronous engine leaves it out; when the
chain is refused, the step in flight is read back and that call ends there, as a synchronous
step would. A row that step N finishes all the same (a stop token or string, an
abort) has its step N+1 row computed and thrown away: its token is never read, its block is
given back as if never taken (BlockManager.free) and never cached (Scheduler.cache_computed).
A request that arrives meanwhile is admitted one step later than the synchronous engine would.
"""

from __future__ import annotations

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

    def launch(self, batch: list[ScheduledSeq], feed: Feed | None) -> SampledTokens: ...


@dataclass(slots=True)
class InFlight:
    batch: list[ScheduledSeq]
    tokens: SampledTokens


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
        self.chained = 0  # steps launched while another was in flight (tests read it)

    def step(self, before_forward: Callable[[], object] | None) -> list[RequestOutput]:
        """LLMEngine.step with a step in flight: the outputs of the step read back in it."""
        prev, self.inflight = self.inflight, None
        finishing: set[Sequence] = set()
        if prev is not None:
            chain = self._chain()
            if chain is None:
                return self._read(prev)  # the synchronous engine's step ends here too
            finishing = chain
        batch = self.scheduler.schedule(finishing)
        if before_forward is not None:
            before_forward()
        if not batch:  # (a chained step always has a row: `_chain` saw to it)
            return [] if prev is None else self._read(prev)
        if not self.runner.can_launch(batch):
            assert prev is None, "a chained step that cannot be launched"
            return self._run_sync(batch)
        feed = None
        if prev is not None:
            from worker.engine.token_readback import Feed  # the torch runner is loaded

            where = {item.seq: row for row, item in enumerate(prev.batch)}
            feed = Feed(prev.tokens.device, [where[item.seq] for item in batch])
        tokens = self.runner.launch(batch, feed)
        outputs = []
        if prev is not None:
            self.chained += 1
            outputs = self._read(prev)  # while the step just launched runs
        self.scheduler.advance(batch)
        self.inflight = InFlight(batch, tokens)
        return outputs

    def _read(self, step: InFlight) -> list[RequestOutput]:
        """Step's tokens read back, its blocks cached, its rows' outputs (as a synchronous
        step's end); a row aborted while it ran is dropped."""
        tokens = step.tokens.tolist()
        self.scheduler.cache_computed(step.batch)
        outputs = []
        for item, token in zip(step.batch, tokens, strict=True):
            seq = item.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            # Still pending meanwhile: a request this token finishes frees its blocks knowing
            # that a step was launched ahead for it (BlockManager.free).
            outputs.append(self._on_token(seq, token))
            seq.num_pending_tokens = 0
        return outputs

    def _chain(self) -> set[Sequence] | None:
        """May the next step be scheduled before the step in flight is read back, as the
        synchronous engine would schedule it whatever that step's tokens are? None if not; else
        the rows that step finishes by length, which the next step leaves out."""
        sched = self.scheduler
        running = sched.running
        if sched.waiting or not self.runner.overlaps:
            return None
        bm = sched.block_manager
        needed = 0
        finishing = set()
        for seq in running:
            if not seq.num_pending_tokens:
                return None
            if (
                seq.num_output_tokens + 1 >= seq.params.max_tokens
                or seq.num_tokens + 1 >= self.max_seq_len
            ):
                finishing.add(seq)
            else:
                needed += bm.blocks_needed(seq, 1)
        rows = len(running) - len(finishing)
        if not rows or rows > sched.max_num_batched_tokens:
            return None
        return finishing if bm.pool.takes_no_cached(needed) else None
