"""PeerLink: the sockets between gateway replicas and the two loops that use them.

Each gateway binds one PUB (`--peer-port`) and connects one SUB to every peer in `--peers`
(its own address may be in the list: a gateway ignores its own batches), and to every peer
discovery names (`set_peers`, --peers-from-kubernetes): ZMQ connects and reconnects on its own,
so a peer not up yet or gone costs nothing but its silence. With a worker token
both are CURVE-secured with the KV events' keys (cachekey.worker_auth): the PUB is a CURVE
server that admits only the client key derived from the same token.

The send loop wakes on a placement or every `heartbeat` seconds and sends one batch without
blocking (PUB drops at its high-water mark rather than wait). The receive loop applies each
batch on the event loop, where admission and the lease change the same counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterable

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from cachekey.worker_auth import ZAP_DOMAIN, CurveKeys, TokenHoldersOnly
from gateway.metrics import GatewayMetrics
from gateway.peers.outbox import PeerOutbox
from gateway.peers.view import PeerView
from gateway.peers.wire import PeerBatch, decode, encode
from gateway.tasks import cancel_and_wait

log = logging.getLogger(__name__)

HEARTBEAT = 0.2  # seconds between batches when nothing is routed (the load stays fresh)
SEND_HWM = 1000  # batches a slow peer may fall behind before its PUB queue drops


class PeerLink:
    def __init__(
        self,
        host: str,
        port: int,
        peers: tuple[str, ...],
        view: PeerView,
        outbox: PeerOutbox,
        metrics: GatewayMetrics,
        curve: CurveKeys | None = None,
    ) -> None:
        self.sender = uuid.uuid4().hex
        self._static = frozenset(f"tcp://{p}" for p in peers)
        self._connected: set[str] = set()
        self._sub: zmq.asyncio.Socket | None = None
        self._bind = f"tcp://{host}:{port}"
        self.view, self.outbox, self.metrics = view, outbox, metrics
        self._curve = curve
        self._ctx = zmq.asyncio.Context()
        self._auth: AsyncioAuthenticator | None = None
        self._seq = 0
        self._dropped = 0
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.subscribe(b"")
        if self._curve is not None:
            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
            keys = self._curve
            self._auth.configure_curve_callback(
                ZAP_DOMAIN.decode(), TokenHoldersOnly(keys, "peers", log)
            )
            keys.serve(pub)
            keys.connect(sub)
        pub.bind(self._bind)
        self._sub = sub
        self.set_peers(())
        self._tasks = [
            asyncio.create_task(self._send_loop(pub), name="kvgate-peers-send"),
            asyncio.create_task(self._receive_loop(sub), name="kvgate-peers-receive"),
        ]

    def set_peers(self, discovered: Iterable[str]) -> None:
        """Subscribe to the `HOST:PORT`s `--peers` lists and `discovered` names, no others.
        A peer left out is no longer heard; the view drops it after --peer-timeout."""
        assert self._sub is not None, "start() first"
        want = self._static | {f"tcp://{p}" for p in discovered}
        for endpoint in self._connected - want:
            with contextlib.suppress(zmq.ZMQError):  # already gone
                self._sub.disconnect(endpoint)
            self._connected.discard(endpoint)
        for endpoint in want - self._connected:
            try:
                self._sub.connect(endpoint)
            except zmq.ZMQError as e:  # an address ZMQ cannot parse: skip it, keep the rest
                log.warning("peer %s: %s", endpoint, e)
                continue
            self._connected.add(endpoint)

    async def stop(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)

    async def _send_loop(self, pub: zmq.asyncio.Socket) -> None:
        outbox = self.outbox
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HEARTBEAT):
                    await outbox.ready.wait()
            self._seq += 1
            load = self.view.own_load()
            demand = self.view.publish_demand()
            batch = PeerBatch(self.sender, self._seq, time.time(), load, outbox.take(), demand)
            with contextlib.suppress(zmq.Again):
                pub.send(encode(batch), zmq.NOBLOCK)
            self._count(batch)

    def _count(self, batch: PeerBatch) -> None:
        m = self.metrics
        m.peers_up.set(self.view.expire())
        m.peer_placements_dropped.inc(self.outbox.dropped - self._dropped)
        self._dropped = self.outbox.dropped
        m.peer_placements_sent.inc(len(batch.placements))

    async def _receive_loop(self, sub: zmq.asyncio.Socket) -> None:
        m, view = self.metrics, self.view
        while True:
            data = await sub.recv()
            try:
                batch = decode(data)
            except (msgspec.DecodeError, ValueError):
                m.event_errors.labels("peer_batch").inc()
                continue
            if batch.sender == self.sender:
                continue
            m.peer_lag.observe(max(time.time() - batch.sent, 0.0))
            received, applied = view.received, view.applied
            view.apply(batch)
            m.peer_placements_received.inc(view.received - received)
            m.peer_placements_applied.inc(view.applied - applied)
