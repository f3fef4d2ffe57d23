"""KV-event publisher: ZMQ PUB for live batches, ROUTER for replay from a bounded buffer.

The engine core's loop calls `publish()`, which only assigns the sequence number, enqueues the
encoded batch and wakes the publisher thread; that one thread owns both sockets (ZMQ sockets are
not thread-safe), sends on PUB without blocking and answers replay requests. It sleeps in one
poll on the replay socket and a wake-up pipe, so a batch leaves as soon as it is published: a
gateway routing before an eviction reaches it predicts a hit that is gone. The engine loop is
never blocked by a slow or absent subscriber. With events disabled the worker holds a
`NullEventPublisher`, so no caller ever checks whether there is a publisher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq

from cachekey.events import (
    REPLAY_END,
    KVEvent,
    encode_batch,
    replay_reply,
    seq_bytes,
    seq_from_bytes,
)
from cachekey.worker_auth import CurveKeys
from worker.server.curve_auth import CurveGuard

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PublisherConfig:
    host: str
    port: int
    replay_port: int | None
    topic: str
    buffer_size: int = 10_000
    data_parallel_rank: int | None = None
    sndhwm: int = 100_000
    # With a worker token: both sockets are CURVE servers that admit only the gateways.
    curve: CurveKeys | None = None

    def __post_init__(self) -> None:
        if self.port <= 0:
            raise ValueError("the publisher needs a positive port (0 means events disabled)")
        if self.buffer_size <= 0:
            raise ValueError(f"kv-events buffer must be positive, got {self.buffer_size}")
        if self.replay_port is not None and self.replay_port == self.port:
            raise ValueError("--kv-events-replay-port must differ from --kv-events-port")


class EventPublisher(Protocol):
    """What the engine loop needs from a publisher: publish batches, know the last seq."""

    @property
    def last_seq(self) -> int | None: ...

    def start(self) -> None: ...

    def publish(self, events: Sequence[KVEvent]) -> int | None: ...

    def close(self) -> None: ...


class NullEventPublisher:
    """KV events disabled: batches go nowhere and there is no seq."""

    last_seq = None

    def start(self) -> None:
        pass

    def publish(self, events: Sequence[KVEvent]) -> None:
        return None

    def close(self) -> None:
        pass


class KVEventPublisher:
    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self._topic = config.topic.encode()
        self._next_seq = 0
        self._outbox: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_size)
        self._ctx = zmq.Context()
        self._router: zmq.Socket | None = None
        self._guard = CurveGuard(self._ctx, config.curve) if config.curve is not None else None
        # Bind here, in the caller, so a busy port fails the start instead of a thread.
        try:
            self._pub = self._bind(zmq.PUB, config.port, "--kv-events-port")
            self._pub.setsockopt(zmq.SNDHWM, config.sndhwm)
            if config.replay_port is not None:
                self._router = self._bind(zmq.ROUTER, config.replay_port, "--kv-events-replay-port")
        except OSError:
            self._stop_guard()
            self._ctx.destroy(linger=0)
            raise
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="kv-publisher", daemon=True)
        self._stopped = False

    def _bind(self, kind: int, port: int, flag: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._guard is not None:
            self._guard.secure(sock)
        address = f"tcp://{self.config.host}:{port}"
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            raise OSError(f"cannot bind {flag} {port} ({address}): {e.strerror}") from None
        return sock

    @property
    def last_seq(self) -> int | None:
        """Seq of the last batch handed to `publish` (engine loop view), None before any."""
        return self._next_seq - 1 if self._next_seq > 0 else None

    def start(self) -> None:
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> int:
        """Assign the next seq to one batch and enqueue it. Called from the engine loop only."""
        seq = self._next_seq
        self._next_seq += 1
        self._outbox.put((seq, encode_batch(events, self.config.data_parallel_rank)))
        self._wake()
        return seq

    def _wake(self) -> None:
        if self._stopped:
            return  # closed: the pipe may be gone (a loop that outlived its join)
        # A full pipe holds wake-ups enough: the thread is bound to drain the outbox.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def close(self) -> None:
        if self._stopped:
            return
        self._outbox.put(None)
        self._wake()
        self._stopped = True
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
        self._stop_guard()
        self._ctx.term()
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _stop_guard(self) -> None:
        if self._guard is not None:
            self._guard.stop()
            self._guard = None

    # -- publisher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while self._flush_outbox():
            ready = dict(poller.poll())
            if self._wake_r in ready:
                self._drain_wakes()  # before the next flush: a later publish wakes it again
            if self._router is not None and self._router in ready:
                self._answer_replay()

    def _drain_wakes(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _flush_outbox(self) -> bool:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            self._send(*item)

    def _send(self, seq: int, payload: bytes) -> None:
        self._buffer.append((seq, payload))
        self._send_live(seq, payload)

    def _send_live(self, seq: int, payload: bytes) -> None:
        try:
            self._pub.send_multipart([self._topic, seq_bytes(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            # Over the high-water mark: the batch stays in the replay buffer for recovery.
            logger.warning("kv-events PUB over high-water mark; batch %d left to replay", seq)

    def _answer_replay(self) -> None:
        assert self._router is not None
        while True:
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            # DEALER sends [b"", start]; ROUTER prepends the identity.
            if len(frames) < 2 or len(frames[-1]) != 8:
                logger.warning("ignoring malformed kv-events replay request")
                continue
            ident = frames[0]
            start = seq_from_bytes(frames[-1])
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._router.send_multipart([ident, *replay_reply(self._topic, seq, payload)])
            self._router.send_multipart([ident, *REPLAY_END])
