"""AsyncEngine: the API server's side of one engine core process (engine_core.py).

Commands (add, abort, snapshot, reset, LoRA, prefix hints, faults) leave as msgspec messages on
a PUSH socket that never blocks; the core's reports come back on a PULL socket the event loop
reads when it is readable (no thread): one `Steps` message per engine step, whose outputs go to
their requests' queues, and one `Done` per call. Every report is a heartbeat.

The core is dead when it says so (`Dead`), when its process exits (exit_watch.py: a pidfd,
seen at once, even for a SIGKILL; polled every 100 ms where there is none), or when it has sent
nothing for `stall_timeout_s` (the watchdog in app.py): then every pending request and call
fails with a 503, `/health` turns red and new requests are refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from cachekey import BlockKey
from cachekey.openai.errors import APIError
from cachekey.types import Prompt
from worker.engine.llm_engine import EngineStats
from worker.engine.sampling_params import SamplingParams
from worker.server import core_messages as m
from worker.server.core_messages import SnapshotResult
from worker.server.core_process import CoreHandle
from worker.server.errors import EngineDeadError, EngineDiedError
from worker.server.request_stream import RequestStream

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "Health", "SnapshotResult"]


@dataclass(slots=True)
class Health:
    ok: bool
    reason: str | None


class AsyncEngine:
    def __init__(
        self,
        core: CoreHandle,
        *,
        stall_timeout_s: float = 30.0,
        host_seconds: Callable[[int], float] | None = None,
        host_in_thread: bool = False,
    ) -> None:
        """`host_seconds`: a sim worker's modelled host work for a request passed on among
        that many in flight (`--sim-server-model apart` or `thread`, app_state.py); None
        elsewhere. `host_in_thread` (`thread`): spent in one thread beside the event loop."""
        self.core = core
        self.stall_timeout_s = stall_timeout_s
        self._host_seconds = host_seconds
        self._host_thread = ThreadPoolExecutor(1, "sim-host") if host_in_thread else None
        self._encode = m.encoder().encode
        self._decode = m.report_decoder().decode
        self._sinks: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_reason: str | None = None
        self._beat = time.monotonic()
        self._stats: EngineStats = core.ready.stats

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._beat = time.monotonic()
        loop.add_reader(self.core.reports.getsockopt(zmq.FD), self._read_reports)
        self.core.exit_watch.start(loop, self._on_exit)
        self._read_reports()  # what arrived before the reader was watching

    def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.core.reports.getsockopt(zmq.FD))
            self.core.exit_watch.stop()
        if self._dead_reason is None:
            self._dead_reason = "the worker is shutting down"
        if self._host_thread is not None:
            self._host_thread.shutdown(wait=False, cancel_futures=True)
        self.core.stop()

    # -- state seen by the HTTP layer -------------------------------------------------------------

    def health(self) -> Health:
        if self._dead_reason is not None:
            return Health(False, self._dead_reason)
        age = time.monotonic() - self._beat
        if age > self.stall_timeout_s:
            return Health(False, f"engine loop stalled for {age:.1f}s")
        return Health(True, None)

    def stats(self) -> EngineStats:
        """The stats the core last sent (refreshed every ~100 ms, at each admission and exit)."""
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
        param: str = "messages",
    ) -> RequestStream:
        """Add len(request_ids) engine requests sharing `prompt` (or one prompt each, given a
        list, as the inputs of one embeddings request); bad input raises here, naming `param`
        (the request field of the prompt) where the prompt is to blame.

        The caller iterates the returned stream and must `close()` it (aborting what is left).
        """
        sink: asyncio.Queue = asyncio.Queue()
        for rid in request_ids:
            self._sinks[rid] = sink
        prompts = [prompt] if isinstance(prompt, Prompt) else list(prompt)
        rids, ps = list(request_ids), list(params)
        try:
            if self._host_seconds is not None:
                await self._hold_host(self._host_seconds(len(self._sinks)))
            # One command adds all n, so siblings enter the same step and share the prompt blocks.
            await self._call(
                lambda call: m.Add(
                    call, rids, prompts, ps, lora_name, cache_salt, hidden_states, param
                )
            )
        except BaseException:
            # Failed or cancelled: the requests may exist, with nobody to read.
            self.release(request_ids, unfinished=request_ids)
            raise
        return RequestStream(self.release, request_ids, sink)

    async def _hold_host(self, seconds: float) -> None:
        """A sim worker's modelled host work, paid one request at a time: `apart` blocks the
        event loop on purpose, as rendering on it would (every stream and every new request's
        headers wait meanwhile); `thread` spends it in one thread beside the loop, as rendering
        off the loop would, so the loop goes on reading requests and streaming."""
        if self._host_thread is None:
            time.sleep(seconds)
        else:
            await asyncio.get_running_loop().run_in_executor(self._host_thread, time.sleep, seconds)

    async def add_lora(self, name: str, path: str, replace: bool = False) -> None:
        await self._call(lambda call: m.AddLora(call, name, path, replace))

    async def remove_lora(self, name: str) -> None:
        await self._call(lambda call: m.RemoveLora(call, name))

    async def snapshot(self) -> SnapshotResult:
        return await self._call(m.Snapshot)

    async def reset_prefix_cache(self) -> bool:
        return await self._call(m.Reset)

    def refresh_prefix(self, key: BlockKey) -> None:
        """The gateway's prefix hint, applied between steps; nothing waits for it."""
        self._send(m.RefreshPrefix(key))

    def inject_fault(self, kind: str, count: int = 1) -> None:
        self._send(m.Fault(kind, count))

    def release(self, request_ids: Sequence[str], unfinished: Sequence[str] = ()) -> None:
        """Stop routing outputs to `request_ids`, and abort those of them still `unfinished`."""
        for rid in request_ids:
            self._sinks.pop(rid, None)
        if unfinished and self._dead_reason is None:
            self._send(m.Abort(list(unfinished)))

    def fail_all_pending(self, reason: str) -> None:
        """Fail every in-flight request (`engine_died`: it was in the engine) and call
        (`engine_dead`): the core died or stalled while they waited."""
        died = EngineDiedError(reason)
        for sink in set(self._sinks.values()):
            sink.put_nowait(died)
        err = EngineDeadError(reason)
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(err)

    # -- plumbing ------------------------------------------------------------------------------

    async def _call(self, make) -> object:
        self.check_alive()
        call = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call] = fut
        try:
            self._send(make(call))
            return await fut
        finally:
            self._calls.pop(call, None)

    def _send(self, command: m.Command) -> None:
        with contextlib.suppress(zmq.ZMQError):  # closed at shutdown: nobody waits any more
            self.core.commands.send(self._encode(command), zmq.NOBLOCK)

    def _read_reports(self) -> None:
        # ZMQ's FD is edge-triggered: read until nothing is left, every time it fires.
        reports = self.core.reports
        while True:
            try:
                raw = reports.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return  # closed at shutdown
            self._beat = time.monotonic()
            self._on_report(self._decode(raw))

    def _on_report(self, report: m.Report) -> None:
        if isinstance(report, m.Steps):
            if report.stats is not None:
                self._stats = report.stats
            sinks = self._sinks
            for out in report.outputs:
                sink = sinks.get(out.request_id)
                if sink is not None:
                    sink.put_nowait(out)
        elif isinstance(report, m.Done):
            fut = self._calls.get(report.call)
            if fut is None or fut.done():
                return
            if report.error is not None:
                e = report.error
                fut.set_exception(APIError(e.status, e.message, param=e.param, code=e.code))
            else:
                fut.set_result(report.value)
        elif isinstance(report, m.Dead):
            self._die(report.reason)

    def _on_exit(self) -> None:
        self._read_reports()  # a Dead it sent before exiting says more than its exit status
        code = self.core.proc.wait()
        self._die(f"engine core process exited (status {code})")

    def _die(self, reason: str) -> None:
        if self._dead_reason is None:
            logger.error("engine core dead: %s", reason)
            self._dead_reason = reason
        self.fail_all_pending(self._dead_reason)
