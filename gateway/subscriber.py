"""One KV-event subscriber per worker instance: ZMQ SUB, DEALER replay, `/kv/snapshot` resync.

Start: subscribe first, then load the snapshot, then apply only batches newer than the
snapshot's seq (older ones already sit in the socket buffer and are skipped). A seq gap is
closed by replay from the worker's ROUTER; a replay that cannot cover it, or a seq that goes
backwards (an engine restart under a fixed topic, as vLLM does), drops the replica's entries
and reloads the snapshot. A worker without `/kv/snapshot` (plain vLLM) restarts from empty.
A new worker instance gets a new subscriber (the replica manager sees the instance id change).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx
import zmq
import zmq.asyncio

from cachekey.documents import Snapshot, decode_document
from cachekey.events import END_SEQ, DecodeError, decode_batch, seq_bytes
from cachekey.events import seq_from_bytes as seq_of
from cachekey.keys import HashNamespace
from gateway.index import BlockIndex, ReplicaId
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one worker instance publishes: its events endpoints and snapshot URL."""

    instance_id: str
    host: str
    port: int
    replay_port: int | None
    topic: str
    snapshot_url: str | None

    def endpoint(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{port}"

    @property
    def ipv6(self) -> bool:
        return ":" in self.host


class KVEventSubscriber:
    def __init__(
        self,
        replica: ReplicaId,
        source: EventSource,
        ns: HashNamespace,
        index: BlockIndex,
        http: httpx.AsyncClient,
        zmq_ctx: zmq.asyncio.Context,
        metrics: GatewayMetrics,
        replay_timeout: float = 2.0,
    ) -> None:
        self.replica = replica
        self.source = source
        self.ns = ns
        self.index = index
        self._http = http
        self._ctx = zmq_ctx
        self._metrics = metrics
        self._replay_timeout = replay_timeout
        self.next_seq = 0
        self.synced = asyncio.Event()
        self._last_sub_seq: int | None = None

    @property
    def last_seq(self) -> int | None:
        return self.next_seq - 1 if self.next_seq > 0 else None

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.IPV6, self.source.ipv6)
        try:
            sub.connect(self.source.endpoint(self.source.port))
            sub.subscribe(self.source.topic.encode())
            await self.resync(current_seq=None)
            self.synced.set()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) == 3:
                    await self._on_batch(seq_of(frames[1]), frames[2])
        finally:
            sub.close(linger=0)

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        last = self._last_sub_seq
        self._last_sub_seq = seq
        if last is not None and seq <= last:
            log.warning("%s: event seq went back %d -> %d; resync", self.replica, last, seq)
            await self.resync(current_seq=seq)
            if seq == self.next_seq:
                self._apply(seq, payload)
            return
        if seq < self.next_seq:
            return  # covered by the snapshot or a replay
        if seq > self.next_seq:
            self._metrics.event_gaps.inc()
            if not await self._replay(self.next_seq):
                await self.resync(current_seq=seq)
            if seq != self.next_seq:
                return
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        try:
            batch = decode_batch(payload)
        except DecodeError as e:
            log.warning("%s: undecodable batch %d: %s", self.replica, seq, e)
            return
        before = self.index.skipped_unknown_parent
        n = self.index.apply(self.replica, self.ns, batch.events)
        self._metrics.events_applied.labels(self.replica).inc(n)
        skipped = self.index.skipped_unknown_parent - before
        if skipped:
            self._metrics.skipped_unknown_parent.inc(skipped)

    async def _replay(self, start: int) -> bool:
        """Fetch batches >= start from the worker's replay buffer; False if it cannot cover."""
        if self.source.replay_port is None:
            return False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, self.source.ipv6)
        frames: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.source.endpoint(self.source.replay_port))
            await dealer.send_multipart([b"", seq_bytes(start)])
            while True:
                msg = await asyncio.wait_for(dealer.recv_multipart(), self._replay_timeout)
                if len(msg) != 3 or msg[1] == END_SEQ:
                    break
                frames.append((seq_of(msg[1]), msg[2]))
        except (TimeoutError, zmq.ZMQError) as e:
            log.warning("%s: replay from %d failed: %s", self.replica, start, e)
            return False
        finally:
            dealer.close(linger=0)
        if not frames or frames[0][0] > start:
            return False
        for seq, payload in frames:
            if seq == self.next_seq:
                self._apply(seq, payload)
        self._metrics.event_replays.inc()
        return True

    async def resync(self, current_seq: int | None) -> None:
        """Drop this replica's entries and rebuild them from the worker's snapshot."""
        self._metrics.event_resyncs.inc()
        self.index.drop_replica(self.replica)
        snap = await self._fetch_snapshot()
        if snap is None:
            # No snapshot endpoint (plain vLLM): start from empty at the current batch.
            self.next_seq = current_seq if current_seq is not None else 0
            return
        self.load_snapshot(snap)

    async def _fetch_snapshot(self) -> Snapshot | None:
        """The worker's snapshot; None when it has none. A malformed one raises DocumentError,
        which restarts this subscriber (logged with the field at fault)."""
        if self.source.snapshot_url is None:
            return None
        try:
            resp = await self._http.get(self.source.snapshot_url, timeout=30.0)
        except httpx.HTTPError as e:
            log.warning("%s: snapshot failed: %s", self.replica, e)
            return None
        if resp.status_code != 200:
            return None
        return decode_document(resp.content, Snapshot)

    def load_snapshot(self, snap: Snapshot) -> None:
        applied = sum(self.index.store(self.replica, self.ns, ev) for ev in snap.stored_events())
        self._metrics.events_applied.labels(self.replica).inc(applied)
        self.next_seq = snap.seq + 1 if snap.seq is not None else 0
