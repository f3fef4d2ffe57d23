"""The engine core: the process that owns the LLMEngine, its step loop and its KV-event publisher.

Started by the worker (core_process.py, `python -m worker.server.engine_core`), it loads the
model, binds the publisher and says `Ready`; then it loops, as vLLM v1's EngineCore: take the
commands waiting on its PULL socket (blocking while idle), run one `LLMEngine.step`, send that
step's outputs in one `Steps` message, publish the step's KV events. Evictions go out from the
step's `before_forward` hook, stores after the outputs; since batches get their seq here, a
snapshot taken between steps knows exactly which seq it reflects. An idle loop sends an empty
`Steps` every `_IDLE_WAIT_S` as its heartbeat.

If anything escapes a step, the core sends `Dead` and exits. It also exits when the API server
dies: its stdin is a pipe only the API server holds, so end-of-file there means no parent (and
on Linux the kernel kills it then anyway, should a step hang).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import msgspec
import zmq

from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.server import core_messages as m
from worker.server.core_process import CoreSpec
from worker.server.errors import as_api_error
from worker.server.faults import DroppingKVEventPublisher, InjectedCrash
from worker.server.kv_publisher import EventPublisher, KVEventPublisher, NullEventPublisher

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.2
_STATS_EVERY_S = 0.1
_PR_SET_PDEATHSIG = 1


class ParentGone(Exception):
    """The API server's end of stdin closed: nobody is left to serve."""


class EngineCore:
    def __init__(
        self,
        engine: LLMEngine,
        publisher: EventPublisher,
        commands: zmq.Socket,
        reports: zmq.Socket,
    ) -> None:
        self.engine = engine
        self.publisher = publisher
        self._commands = commands
        self._reports = reports
        self._poller = zmq.Poller()
        self._poller.register(commands, zmq.POLLIN)
        self._poller.register(sys.stdin.fileno(), zmq.POLLIN)
        self._encode = m.encoder().encode
        self._decode = m.command_decoder().decode
        self._stopping = False
        self._stats_at = 0.0

    def run(self) -> None:
        """Loop until Shutdown or the API server's death; an escaping error sends `Dead`."""
        try:
            self._loop_forever()
        except ParentGone:
            logger.warning("engine core: the API server is gone, exiting")
        except BaseException as e:  # anything escaping the loop means the engine is gone
            logger.exception("engine loop died")
            self._send(m.Dead(f"engine loop died: {type(e).__name__}: {e}"))
            raise

    def _loop_forever(self) -> None:
        engine = self.engine
        publish_events = self._publish_events
        while not self._stopping:
            busy = engine.has_unfinished_requests()
            changed = self._take_commands(block=not busy)
            outputs: list = []
            if engine.has_unfinished_requests():
                # The step's evictions go out before its forward pass, its stores after its
                # outputs (with --async-scheduling, with the next step's evictions).
                outputs = engine.step(publish_events)
                changed = changed or any(o.finished for o in outputs)
            # Stats follow every admission and exit at once; token counters may lag ~100 ms.
            now = time.monotonic()
            stats = None
            if changed or not busy or now - self._stats_at > _STATS_EVERY_S:
                stats, self._stats_at = engine.stats(), now
            if outputs or stats is not None:
                self._send(m.Steps(outputs, stats))
            publish_events()

    def _take_commands(self, block: bool) -> bool:
        ready = dict(self._poller.poll(_IDLE_WAIT_S * 1000 if block else 0))
        if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 4096):
            raise ParentGone
        if self._commands not in ready:
            return False
        while True:
            try:
                raw = self._commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            self._handle(self._decode(raw))

    def _handle(self, cmd: m.Command) -> None:
        engine = self.engine
        if isinstance(cmd, m.Add):
            self._answer(cmd.call, lambda: self._add_all(cmd))
        elif isinstance(cmd, m.Abort):
            for rid in cmd.request_ids:
                engine.abort_request(rid)  # a no-op for one that finished meanwhile
        elif isinstance(cmd, m.RefreshPrefix):
            engine.refresh_prefix(cmd.key)  # errors here are the loop's own
        elif isinstance(cmd, m.Snapshot):
            self._answer(cmd.call, self._snapshot)
        elif isinstance(cmd, m.Reset):
            self._answer(cmd.call, engine.reset_prefix_cache)
        elif isinstance(cmd, m.AddLora):
            self._answer(cmd.call, lambda: engine.add_lora(cmd.name, cmd.path, cmd.replace), True)
        elif isinstance(cmd, m.RemoveLora):
            self._answer(cmd.call, lambda: engine.remove_lora(cmd.name), True)
        elif isinstance(cmd, m.Fault):
            self._fault(cmd)
        elif isinstance(cmd, m.Shutdown):
            self._stopping = True

    def _answer(self, call: int, work: Callable[[], object], restat: bool = False) -> None:
        try:
            done = m.Done(call, work())  # type: ignore[arg-type]
        except Exception as e:  # one bad request fails alone
            err = as_api_error(e)
            done = m.Done(call, error=m.CallError(err.status, err.message, err.param, err.code))
        if restat:  # the model list shows a LoRA change once its call returns
            self._send(m.Steps([], self.engine.stats()))
        self._send(done)

    def _add_all(self, cmd: m.Add) -> None:
        prompts = cmd.prompts * len(cmd.request_ids) if len(cmd.prompts) == 1 else cmd.prompts
        added: list[str] = []
        try:
            for rid, prompt, params in zip(cmd.request_ids, prompts, cmd.params, strict=True):
                self.engine.add_request(
                    rid,
                    prompt,
                    params,
                    lora_name=cmd.lora_name,
                    cache_salt=cmd.cache_salt,
                    hidden_states=cmd.hidden_states,
                    param=cmd.param,
                )
                added.append(rid)
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            raise

    def _snapshot(self) -> m.SnapshotResult:
        # Publish what is pending first, so the snapshot reflects exactly the last seq.
        self._publish_events()
        engine = self.engine
        return m.SnapshotResult(
            self.publisher.last_seq, engine.snapshot_blocks(), engine.snapshot_host_blocks()
        )

    def _fault(self, cmd: m.Fault) -> None:
        if cmd.kind == "crash_engine":
            raise InjectedCrash("fault injection: crash_engine")
        if cmd.kind == "stall_engine":
            # Stalled until the API server goes away (or stops this process at shutdown).
            while os.read(sys.stdin.fileno(), 4096):
                pass
            raise ParentGone
        if cmd.kind == "drop_events" and isinstance(self.publisher, DroppingKVEventPublisher):
            self.publisher.drop_next(cmd.count)

    def _publish_events(self) -> None:
        events = self.engine.drain_events()
        if events:
            self.publisher.publish(events)

    def _send(self, report: m.Report) -> None:
        self._reports.send(self._encode(report))


def _publisher(spec: CoreSpec) -> EventPublisher:
    if spec.publisher is None:
        return NullEventPublisher()
    if spec.fault_injection:
        return DroppingKVEventPublisher(spec.publisher)
    return KVEventPublisher(spec.publisher)


def _load(spec: CoreSpec) -> tuple[LLMEngine, EventPublisher]:
    engine = LLMEngine(spec.engine)
    return engine, _publisher(spec)


def serve(spec: CoreSpec) -> int:
    """Load, say Ready (or Failed), run the loop; the process's exit status."""
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PUSH)
    reports.setsockopt(zmq.LINGER, 2000)  # a Dead or Failed must reach the API server
    reports.connect(spec.reports_address)
    commands = ctx.socket(zmq.PULL)
    commands.setsockopt(zmq.LINGER, 0)
    commands.connect(spec.commands_address)
    encode = m.encoder().encode
    try:
        engine, publisher = _load(spec)
    except (ValueError, OSError) as e:
        reports.send(encode(m.Failed(str(e))))
        ctx.destroy(linger=2000)
        return 2
    publisher.start()
    stats = engine.stats()
    reports.send(encode(m.Ready(engine.max_model_len, engine.runner.hidden.row_layers, stats)))
    try:
        EngineCore(engine, publisher, commands, reports).run()
    except BaseException:
        return 1
    finally:
        publisher.close()
        with contextlib.suppress(zmq.ZMQError):
            reports.close(2000)
            commands.close(0)
        ctx.term()
    return 0


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the API server dies, even while a step hangs
    in native code and the loop cannot notice stdin's end-of-file."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _leave_stopping_to_the_api_server(signum: int, _frame: object) -> None:
    name = signal.Signals(signum).name
    logger.info("%s ignored: the API server drains, then stops this core", name)


def main() -> int:
    # Ctrl-C, and a SIGTERM sent to the whole process group (systemd's default stop, `kill --
    # -PGID`, a harness stopping a cluster), reach the core too: the API server alone decides
    # when it stops, once its streams have drained (a Shutdown, or its stdin's end when it
    # dies). A handler, not SIG_IGN, for SIGTERM: the processes a core execs (compilers) keep
    # the default.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _leave_stopping_to_the_api_server)
    _die_with_parent()
    spec = msgspec.json.decode(sys.stdin.buffer.readline(), type=CoreSpec)
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s %(levelname)s engine-core[{os.getpid()}] %(name)s: %(message)s",
    )
    assert isinstance(spec.engine, EngineConfig)
    return serve(spec)


def _exit(code: int) -> None:
    """End without the interpreter's teardown: serve() has closed the sockets and the publisher,
    and unloading torch's modules is half a second of every stop. Logs and output go first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
