"""AsyncEngine: one thread owns the synchronous LLMEngine; asyncio code talks to it by queue.

The engine thread takes commands (add, abort, snapshot, reset), runs `LLMEngine.step` while
there is work, hands each RequestOutput to its request's asyncio queue with one
`call_soon_threadsafe` per step, and publishes the events it drains from the engine: the
evictions from the step's `before_forward` hook, the stores once its outputs are handed over.
Because batches get their seq in this thread, a snapshot taken here between steps knows exactly
which seq it reflects. If anything escapes a step, the engine is dead: pending requests fail,
`/health` turns 503 and new requests are refused at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from cachekey.types import Prompt
from worker.engine.llm_engine import CachedBlock, EngineStats, LLMEngine, RequestOutput
from worker.engine.sampling_params import SamplingParams
from worker.server.errors import EngineDeadError
from worker.server.kv_publisher import EventPublisher
from worker.server.request_stream import RequestStream

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.2
_STATS_EVERY_S = 0.1

Command = Callable[[LLMEngine], Any]


@dataclass(slots=True)
class Health:
    ok: bool
    reason: str | None


@dataclass(slots=True)
class SnapshotResult:
    seq: int | None
    blocks: list[CachedBlock]


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        publisher: EventPublisher,
        *,
        stall_timeout_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.publisher = publisher
        self.stall_timeout_s = stall_timeout_s
        self._commands: queue.SimpleQueue[tuple[Command, Future | None]] = queue.SimpleQueue()
        self._sinks: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stop = threading.Event()
        self._dead_reason: str | None = None
        self._beat = time.monotonic()
        self._stats: EngineStats = engine.stats()
        self._stats_at = 0.0

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._beat = time.monotonic()
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    # -- state seen by the HTTP layer -------------------------------------------------------------

    def health(self) -> Health:
        age = time.monotonic() - self._beat
        if self._dead_reason is not None:
            return Health(False, self._dead_reason)
        if not self._thread.is_alive():
            return Health(False, "engine thread is not running")
        if age > self.stall_timeout_s:
            return Health(False, f"engine loop stalled for {age:.1f}s")
        return Health(True, None)

    def stats(self) -> EngineStats:
        """The stats the engine thread last recorded (refreshed every ~100 ms and when idle)."""
        return self._stats

    def check_alive(self) -> None:
        h = self.health()
        if not h.ok:
            raise EngineDeadError(h.reason or "unknown")

    # -- requests ------------------------------------------------------------------------------

    async def add(
        self,
        request_ids: Sequence[str],
        prompt: Prompt | Sequence[Prompt],
        params: Sequence[SamplingParams],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        hidden_states: str | None = None,
    ) -> RequestStream:
        """Add len(request_ids) engine requests sharing `prompt` (or one prompt each, given a
        list, as the inputs of one embeddings request); bad input raises here.

        The caller iterates the returned stream and must `close()` it (aborting what is left).
        """
        sink: asyncio.Queue = asyncio.Queue()
        for rid in request_ids:
            self._sinks[rid] = sink
        try:
            # One command adds all n, so siblings enter the same step and share the prompt blocks.
            await self._call(
                _add_all(request_ids, prompt, params, lora_name, cache_salt, hidden_states)
            )
        except BaseException:
            # Cancelled while the add was running: the requests may exist, with nobody to read.
            self.release(request_ids, unfinished=request_ids)
            raise
        return RequestStream(self.release, request_ids, sink)

    async def add_lora(self, name: str, path: str, replace: bool = False) -> None:
        def command(engine: LLMEngine) -> None:
            engine.add_lora(name, path, replace)
            self._stats = engine.stats()  # the model list shows it once this returns

        await self._call(command)

    async def remove_lora(self, name: str) -> None:
        def command(engine: LLMEngine) -> None:
            engine.remove_lora(name)
            self._stats = engine.stats()

        await self._call(command)

    async def snapshot(self) -> SnapshotResult:
        return await self._call(self._snapshot)

    async def reset_prefix_cache(self) -> bool:
        return await self._call(lambda engine: engine.reset_prefix_cache())

    def post(self, command: Command) -> None:
        """Run `command(engine)` on the engine thread between steps, without waiting for it.

        Whatever it raises is the loop's own: it kills the engine, as an exception from a step
        does.
        """
        self._submit(command, None)

    def release(self, request_ids: Sequence[str], unfinished: Sequence[str] = ()) -> None:
        """Stop routing outputs to `request_ids`, and abort those of them still `unfinished`."""
        for rid in request_ids:
            self._sinks.pop(rid, None)
        if unfinished and self._dead_reason is None:
            self._submit(_abort(list(unfinished)), None)

    def fail_all_pending(self, reason: str) -> None:
        """Fail every in-flight request (watchdog: the engine stalled while they waited)."""
        err = EngineDeadError(reason)
        for sink in set(self._sinks.values()):
            sink.put_nowait(err)

    # -- plumbing ------------------------------------------------------------------------------

    async def _call(self, command: Command) -> Any:
        self.check_alive()
        fut: Future = Future()
        self._submit(command, fut)
        return await asyncio.wrap_future(fut)

    def _submit(self, command: Command, fut: Future | None) -> None:
        self._commands.put((command, fut))
        # The loop may have died between the check and the put: its drain may have missed us.
        if self._dead_reason is not None and fut is not None:
            _fail(fut, EngineDeadError(self._dead_reason))

    def _snapshot(self, engine: LLMEngine) -> SnapshotResult:
        # Publish what is pending first, so the snapshot reflects exactly the last seq.
        self._publish_events()
        return SnapshotResult(self.publisher.last_seq, engine.snapshot_blocks())

    # -- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as e:  # anything escaping the loop means the engine is gone
            logger.exception("engine loop died")
            self._die(f"engine loop died: {type(e).__name__}: {e}")

    def _loop_forever(self) -> None:
        engine = self.engine
        publish_events = self._publish_events
        while not self._stop.is_set():
            self._beat = time.monotonic()
            busy = engine.has_unfinished_requests()
            changed = self._run_commands(block=not busy)
            if engine.has_unfinished_requests():
                # The step's evictions go out before its forward pass, its stores after its
                # outputs.
                outputs = engine.step(publish_events)
                self._deliver(outputs)
                changed = changed or any(o.finished for o in outputs)
            publish_events()
            # Stats follow every admission and exit at once; token counters may lag ~100 ms.
            now = time.monotonic()
            if changed or not busy or now - self._stats_at > _STATS_EVERY_S:
                self._stats = engine.stats()
                self._stats_at = now

    def _run_commands(self, block: bool) -> bool:
        try:
            item = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return False
        while True:
            command, fut = item
            if fut is None:
                command(self.engine)  # posted commands: errors here are the loop's own
            elif fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(command(self.engine))
                except Exception as e:  # one bad request fails alone
                    fut.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        routed = [(self._sinks.get(o.request_id), o) for o in outputs]
        routed = [(s, o) for s, o in routed if s is not None]
        if routed and self._loop is not None:
            self._loop.call_soon_threadsafe(_put_all, routed)

    def _publish_events(self) -> None:
        events = self.engine.drain_events()
        if events:
            self.publisher.publish(events)

    def _die(self, reason: str) -> None:
        self._dead_reason = reason
        err = EngineDeadError(reason)
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut is not None:
                _fail(fut, err)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                self._loop.call_soon_threadsafe(self.fail_all_pending, reason)


def _fail(fut: Future, err: Exception) -> None:
    # Either side may get there first; the loser finds the future already taken.
    with contextlib.suppress(InvalidStateError, RuntimeError):
        if fut.set_running_or_notify_cancel():
            fut.set_exception(err)


def _put_all(routed: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for sink, output in routed:
        sink.put_nowait(output)


def _add_all(
    rids: Sequence[str],
    prompt: Prompt | Sequence[Prompt],
    params: Sequence[SamplingParams],
    lora: str | None,
    salt: str | None,
    hidden: str | None = None,
) -> Command:
    prompts = [prompt] * len(rids) if isinstance(prompt, Prompt) else prompt

    def command(engine: LLMEngine) -> None:
        added: list[str] = []
        try:
            for rid, pr, p in zip(rids, prompts, params, strict=True):
                engine.add_request(
                    rid, pr, p, lora_name=lora, cache_salt=salt, hidden_states=hidden
                )
                added.append(rid)
        except BaseException:
            for rid in added:
                engine.abort_request(rid)
            raise

    return command


def _abort(rids: list[str]) -> Command:
    def command(engine: LLMEngine) -> None:
        for rid in rids:
            engine.abort_request(rid)  # a no-op for one that finished meanwhile

    return command
