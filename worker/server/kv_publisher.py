"""KV-event publisher: ZMQ PUB for live batches, ROUTER for replay from a bounded buffer.

The engine thread calls `publish()`, which only assigns the sequence number and enqueues the
encoded batch; one publisher thread owns both sockets (ZMQ sockets are not thread-safe), sends
on PUB without blocking and answers replay requests. The engine thread is never blocked by a
slow or absent subscriber.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from cachekey.events import (
    REPLAY_END,
    KVEvent,
    encode_batch,
    replay_reply,
    seq_bytes,
    seq_from_bytes,
)

logger = logging.getLogger(__name__)

_POLL_MS = 5


@dataclass(slots=True)
class PublisherConfig:
    host: str
    port: int
    replay_port: int | None
    topic: str
    buffer_size: int = 10_000
    data_parallel_rank: int | None = None
    sndhwm: int = 100_000

    def __post_init__(self) -> None:
        if self.port <= 0:
            raise ValueError("the publisher needs a positive port (0 means events disabled)")
        if self.buffer_size <= 0:
            raise ValueError(f"kv-events buffer must be positive, got {self.buffer_size}")
        if self.replay_port is not None and self.replay_port == self.port:
            raise ValueError("--kv-events-replay-port must differ from --kv-events-port")


class KVEventPublisher:
    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self._topic = config.topic.encode()
        self._next_seq = 0
        self._outbox: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_size)
        self._ctx = zmq.Context()
        # Bind here, in the caller, so a busy port fails the start instead of a thread.
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.sndhwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(f"tcp://{config.host}:{config.port}")
        self._router: zmq.Socket | None = None
        if config.replay_port is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(f"tcp://{config.host}:{config.replay_port}")
        self._thread = threading.Thread(target=self._run, name="kv-publisher", daemon=True)
        self._stopped = False
        # Fault injection only: batches still to withhold from PUB (they stay replayable).
        self._drop_remaining = 0

    @property
    def last_seq(self) -> int | None:
        """Seq of the last batch handed to `publish` (engine thread view), None before any."""
        return self._next_seq - 1 if self._next_seq > 0 else None

    def start(self) -> None:
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> int:
        """Assign the next seq to one batch and enqueue it. Called from the engine thread only."""
        seq = self._next_seq
        self._next_seq += 1
        self._outbox.put((seq, encode_batch(events, self.config.data_parallel_rank)))
        return seq

    def drop_next(self, n: int) -> None:
        """Fault injection: do not send the next n batches on PUB (they stay in the buffer)."""
        if n <= 0:
            raise ValueError(f"drop count must be positive, got {n}")
        self._drop_remaining = n

    def close(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._outbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
        self._ctx.term()

    # -- publisher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while True:
            if not self._flush_outbox():
                return
            if self._router is None:
                item = self._outbox.get()
                if item is None:
                    return
                self._send(*item)
                continue
            if dict(poller.poll(_POLL_MS)):
                self._answer_replay()

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
        if self._drop_remaining > 0:
            self._drop_remaining -= 1
            logger.warning("fault injection: kv-events batch %d not sent", seq)
            return
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
