"""Start the engine core processes (engine_core.py) and wait until each is loaded.

One core per engine (per data-parallel rank). The API server binds two ipc:// sockets per
core in a private temporary directory (commands out, reports in), starts
`python -m worker.server.engine_core` with a `CoreSpec` on its stdin, and keeps that pipe open:
its end-of-file tells the core that the API server is gone. An ExitWatch (a pidfd where the
kernel has them) tells the API server the moment a core exits, however it died.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from cachekey import HashNamespace
from cachekey.assets import ModelAssets
from cachekey.render import Renderer, RenderLimits
from worker.engine.config import EngineConfig
from worker.server import core_messages as m
from worker.server.exit_watch import ExitWatch
from worker.server.kv_publisher import PublisherConfig

_START_TIMEOUT_S = 600.0  # loading a large model takes a while; a dead core is seen at once
_STOP_TIMEOUT_S = 5.0
# A listening core takes Shutdown in milliseconds; only then is its stdin closed: closed at once,
# it read the end-of-file first and logged that its API server was gone.
_SHUTDOWN_GRACE_S = 1.0


class CoreSpec(msgspec.Struct):
    """What the core process needs to load its engine and reach the API server."""

    engine: EngineConfig
    publisher: PublisherConfig | None
    commands_address: str
    reports_address: str
    fault_injection: bool = False
    log_level: str = "info"


class CoreStartError(ValueError):
    """The core could not load its engine or bind its ports: the worker cannot start."""


@dataclass
class CoreHandle:
    """One running core and what the API server knows of its engine."""

    proc: subprocess.Popen
    commands: zmq.Socket  # PUSH
    reports: zmq.Socket  # PULL
    exit_watch: ExitWatch
    ready: m.Ready
    config: EngineConfig
    assets: ModelAssets
    renderer: Renderer
    namespace: HashNamespace
    _dir: str
    _closed: bool = False

    def stop(self) -> None:
        """Ask the core to stop; kill it if it does not (a stalled loop cannot listen). A second
        call does nothing."""
        if self._closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self.commands.send(m.encoder().encode(m.Shutdown()), zmq.NOBLOCK)
        try:
            self.proc.wait(timeout=_SHUTDOWN_GRACE_S)
        except subprocess.TimeoutExpired:
            if self.proc.stdin is not None:  # its end-of-file ends a stalled loop too
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
            try:
                self.proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self.commands.close(0)
        self.reports.close(0)
        self.exit_watch.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class StartingCore:
    """A core process started and not yet heard from (`await_cores`)."""

    proc: subprocess.Popen
    commands: zmq.Socket
    reports: zmq.Socket
    engine: EngineConfig
    folder: str

    def abandon(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self.commands.close(0)
        self.reports.close(0)
        shutil.rmtree(self.folder, ignore_errors=True)


def spawn_cores(
    ctx: zmq.Context, specs: Sequence[tuple[EngineConfig, PublisherConfig | None]], **common
) -> list[StartingCore]:
    """Start one core per (engine, publisher) config, all at once; `await_cores` waits for
    them, and the caller may do its own start-up meanwhile."""
    starting: list[StartingCore] = []
    try:
        for engine, publisher in specs:
            starting.append(_spawn(ctx, engine, publisher, **common))
    except BaseException:
        for core in starting:
            core.abandon()
        raise
    return starting


def await_cores(starting: Sequence[StartingCore], limits: RenderLimits) -> list[CoreHandle]:
    """Wait until every core has loaded; on a failure stop them all and raise CoreStartError
    with the core's message. `limits`: what the API server's renderer takes of images."""
    handles: list[CoreHandle] = []
    try:
        for core in starting:
            handles.append(_await_ready(core, limits))
    except BaseException:
        for h in handles:
            h.stop()
        for core in starting[len(handles) :]:
            core.abandon()
        raise
    return handles


def _spawn(ctx: zmq.Context, engine: EngineConfig, publisher: PublisherConfig | None, **common):
    folder = tempfile.mkdtemp(prefix="kvgate-core-")
    commands, reports = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for sock in (commands, reports):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # commands never block the event loop
        sock.setsockopt(zmq.RCVHWM, 0)
    commands.bind(f"ipc://{folder}/commands")
    reports.bind(f"ipc://{folder}/reports")
    spec = CoreSpec(engine, publisher, f"ipc://{folder}/commands", f"ipc://{folder}/reports")
    spec = msgspec.structs.replace(spec, **common)
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.server.engine_core"], stdin=subprocess.PIPE
    )
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode(spec) + b"\n")
    proc.stdin.flush()  # and kept open: its end-of-file is the API server's death
    return StartingCore(proc, commands, reports, engine, folder)


def _await_ready(core: StartingCore, limits: RenderLimits) -> CoreHandle:
    decode = m.report_decoder().decode
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if core.reports.poll(100):
            report = decode(core.reports.recv())
            if isinstance(report, m.Failed):
                core.abandon()
                raise CoreStartError(report.message)
            if isinstance(report, m.Ready):
                return _handle(core, report, limits)
        elif core.proc.poll() is not None:
            core.abandon()
            raise CoreStartError(f"the engine core exited while loading ({core.proc.returncode})")
    core.abandon()
    raise CoreStartError(f"the engine core did not load in {_START_TIMEOUT_S:.0f}s")


def _handle(core: StartingCore, ready: m.Ready, limits: RenderLimits) -> CoreHandle:
    engine = core.engine
    assets = ModelAssets.from_dir(engine.model)
    assert engine.served_model_name is not None
    namespace = HashNamespace(engine.served_model_name, engine.block_size, engine.hash_seed)
    return CoreHandle(
        core.proc, core.commands, core.reports, ExitWatch(core.proc), ready, engine, assets,
        Renderer(assets, limits=limits), namespace, core.folder,
    )  # fmt: skip
