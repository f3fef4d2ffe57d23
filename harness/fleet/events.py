"""The fleet's KV-event publishers: per replica a ZMQ PUB for live batches and a ROUTER for replay,
in the kvgate worker's wire format (cachekey.events), all on the fleet's one event loop.

The worker's own publisher (worker/server/kv_publisher.py) runs a thread and a ZMQ context per
engine; 512 of them would be 512 threads and 512 ZMQ I/O threads. Here one context serves every
replica: PUB sends never block (a batch over the high-water mark is left to replay, as the
worker does), and each ROUTER is read by one task of the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque

import zmq
import zmq.asyncio

from cachekey.events import (
    REPLAY_END,
    KVEvent,
    encode_batch,
    replay_reply,
    seq_bytes,
    seq_from_bytes,
)

log = logging.getLogger(__name__)


class FleetZmq:
    """One ZMQ context for the whole fleet, allowed two sockets per replica."""

    def __init__(self, replicas: int) -> None:
        self.ctx = zmq.Context()
        self.ctx.MAX_SOCKETS = 2 * replicas + 64  # libzmq's default (1023) fits 511 replicas
        self.actx = zmq.asyncio.Context.shadow(self.ctx)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _bound_port(sock: zmq.Socket) -> int:
    return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


class ReplicaEvents:
    """One replica's publisher: `publish` from the loop, `serve_replay` as a task."""

    def __init__(
        self,
        zmq_: FleetZmq,
        host: str,
        topic: str,
        buffer_size: int,
        port: int = 0,
        replay_port: int = 0,
    ) -> None:
        self.topic = topic.encode()
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._pub = zmq_.ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._router = zmq_.actx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # Replies go out through a plain handle on the same socket: a ROUTER never blocks.
        self._reply = zmq.Socket.shadow(self._router.underlying)
        try:
            self._pub.bind(f"tcp://{host}:{port or '*'}")
            self._router.bind(f"tcp://{host}:{replay_port or '*'}")
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"cannot bind the fleet's KV-event sockets on {host}: {e}") from None
        self.port, self.replay_port = _bound_port(self._pub), _bound_port(self._router)

    @property
    def last_seq(self) -> int | None:
        return self._next_seq - 1 if self._next_seq else None

    def publish(self, events: list[KVEvent]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(events)
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self.topic, seq_bytes(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("PUB over high-water mark; batch %d left to replay", seq)

    async def serve_replay(self) -> None:
        """Answer every replay request: each buffered batch from the asked seq on, then END."""
        router, reply = self._router, self._reply
        while True:
            frames = await router.recv_multipart()
            if len(frames) < 2 or len(frames[-1]) != 8:
                continue  # not a replay request
            ident, start = frames[0], seq_from_bytes(frames[-1])
            buffer = self._buffer
            skip = max(start - buffer[0][0], 0) if buffer else 0
            for seq, payload in itertools.islice(buffer, skip, None):
                reply.send_multipart([ident, *replay_reply(self.topic, seq, payload)])
            reply.send_multipart([ident, *REPLAY_END])

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._pub.close(linger=0)
            self._router.close(linger=0)


async def cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
