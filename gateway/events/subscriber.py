"""One KV-event subscriber per worker instance: ZMQ SUB, DEALER replay, `/kv/snapshot` resync.

Start: subscribe, load the snapshot (a kvgate worker) or nothing (plain vLLM), then replay
whatever the worker's buffer holds after it, and from then on apply live batches in seq order.
- A seq gap on the live stream is closed by replay; a replay that cannot reach back, or a seq
  that goes backwards (an engine restart under a fixed topic, as vLLM does), drops the replica's
  entries and syncs again.
- A lost batch with no later batch shows no gap. So after every `tail_check_interval` without a
  live batch the subscriber asks the replay buffer for anything after its last seq: a silent gap
  (the window before a new SUB is live, a batch over the publisher's high-water mark) never
  outlives one interval. The interval is a gateway's shared Pace (gateway/pace.py): past
  `max_tail_checks_per_second` subscribers per interval it stretches, so the checks of a large
  fleet stay within that rate. Without a replay endpoint only the live stream is followed.
A new worker instance gets a new subscriber (the replica manager sees the instance id change).

One subscriber per data-parallel rank (gateway/fleet/ranks.py): each follows its rank's own ports,
and a batch naming another rank is skipped and counted (`wrong_data_parallel_rank`). In connect mode
(`--kv-events-bind`) the live stream is not a SUB of its own but an inbox that the gateway's
central SUB (gateway/events/event_hub.py) fills with this rank's batches; replay and the tail
check are the same, through the worker's replay endpoint.

Batches are decoded, hashed and applied on one ingestion thread (gateway/events/ingest.py), never on
the event loop; each subscriber awaits its batch before the next, so a replica's order is kept.
A malformed batch, event or field is skipped and counted by reason
(`kvgate_event_errors_total{reason}`), logged once per reason; it never ends the subscriber.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import zmq
import zmq.asyncio

from cachekey.documents import Snapshot
from cachekey.events import seq_from_bytes as seq_of
from cachekey.keys import HashNamespace
from gateway.events.event_source import EventSource, fetch_snapshot
from gateway.events.ingest import INGEST, ingest_batch
from gateway.events.replay import REPLAY_ONLY_WARN_AFTER, ReplayClient, replay_only_hint
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.names import ReplicaId
from gateway.pace import Pace

log = logging.getLogger(__name__)


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
        tail_check_interval: float | Pace = 1.0,
        inbox: asyncio.Queue[tuple[int, bytes]] | None = None,
        name: str | None = None,
    ) -> None:
        """`tail_check_interval`: seconds, or the Pace every subscriber of a gateway shares;
        `name`: the replica's name, its metrics' label (default: its id)."""
        if (inbox is None) == (source.port is None):
            raise ValueError("a subscriber follows either its own SUB (a port) or an inbox")
        self._inbox = inbox
        self.replica = replica
        self.name = name or replica
        self.source = source
        self.ns = ns
        self.index = index
        self._http = http
        self._ctx = zmq_ctx
        self._metrics = metrics
        pace = tail_check_interval
        self._pace = pace if isinstance(pace, Pace) else Pace(pace)
        self._idle_wait = self._pace.first_delay
        self._replay = (
            ReplayClient(
                zmq_ctx,
                source.endpoint(source.replay_port),
                ipv6=source.ipv6,
                timeout=replay_timeout,
                name=replica,
                curve=source.curve,
            )
            if source.replay_port is not None
            else None
        )
        self.next_seq = 0
        self.synced = asyncio.Event()
        self._last_sub_seq: int | None = None
        self._replay_only = 0  # tail checks in a row that found batches, no live one between
        self._logged_reasons: set[str] = set()
        # A worker without a snapshot is a plain vLLM worker, whose "full" report mode
        # re-announces the blocks a request hit (gateway/index/block_index.py).
        index.set_reannouncing(replica, source.snapshot_url is None)

    @property
    def inbox(self) -> asyncio.Queue[tuple[int, bytes]] | None:
        """Connect mode: where the central SUB puts this rank's batches."""
        return self._inbox

    @property
    def last_seq(self) -> int | None:
        return self.next_seq - 1 if self.next_seq > 0 else None

    async def run(self) -> None:
        if self._inbox is not None:
            try:
                inbox = self._inbox
                await self._follow(self._from_inbox, lambda: not inbox.empty())
            finally:
                if self._replay is not None:
                    self._replay.close()
            return
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.IPV6, self.source.ipv6)
        if self.source.curve is not None:
            self.source.curve.connect(sub)
        try:
            sub.connect(self.source.endpoint(self.source.port))
            sub.subscribe(self.source.topic.encode())
            await self._follow(
                lambda: self._from_sub(sub), lambda: bool(sub.getsockopt(zmq.EVENTS) & zmq.POLLIN)
            )
        finally:
            sub.close(linger=0)
            if self._replay is not None:
                self._replay.close()

    async def _follow(self, receive, pending) -> None:
        """Sync, then apply live batches in order; an idle interval runs the tail check.
        `pending()`: whether a live batch is waiting to be received."""
        await self.resync(current_seq=None)
        self.synced.set()
        while True:
            item = await receive()
            if item is None:
                await self._check_tail(pending)
            else:
                await self._on_batch(*item)

    def _idle_seconds(self) -> float:
        """How long to wait for a live batch before the tail check (gateway/pace.py)."""
        wait, self._idle_wait = self._idle_wait(), self._pace.delay
        return wait

    async def _from_sub(self, sub: zmq.asyncio.Socket) -> tuple[int, bytes] | None:
        """The next live batch, or None after an idle interval (a malformed one is dropped)."""
        while await sub.poll(int(self._idle_seconds() * 1000), zmq.POLLIN):
            frames = await sub.recv_multipart()
            if len(frames) == 3 and len(frames[1]) == 8:
                return seq_of(frames[1]), frames[2]
        return None

    async def _from_inbox(self) -> tuple[int, bytes] | None:
        assert self._inbox is not None
        try:
            async with asyncio.timeout(self._idle_seconds()):  # not wait_for: tasks.py
                return await self._inbox.get()
        except TimeoutError:
            return None

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        self._replay_only = 0
        last = self._last_sub_seq
        self._last_sub_seq = seq
        if last is not None and seq <= last:
            log.warning("%s: event seq went back %d -> %d; resync", self.replica, last, seq)
            await self.resync(current_seq=seq)
            if seq == self.next_seq:
                await self._apply(seq, payload)
            return
        if seq < self.next_seq:
            return  # covered by the snapshot or a replay
        if seq > self.next_seq:
            self._metrics.event_gaps.inc()
            batches = await self._replayed()
            if batches is not None and await self._apply_run(batches) is not None:
                self._metrics.event_replays.inc()
            else:
                await self.resync(current_seq=seq)
            if seq != self.next_seq:
                return
        await self._apply(seq, payload)

    async def _check_tail(self, pending) -> None:
        """No live batch for one interval: apply any the live stream missed (a silent gap)."""
        batches = await self._replayed()
        if batches is None:
            return  # no replay endpoint, or no answer: the poller decides about the worker
        if pending():
            # A live batch came in while the replay answered: what the replay holds may be that
            # very batch, not one the stream missed. The live path applies it (and replays any
            # gap before it), so nothing is counted as lost that was not.
            return
        applied = await self._apply_run(batches)
        if applied == 0:
            return
        self._metrics.event_gaps.inc()
        self._metrics.event_tail_gaps.inc()
        if applied is None:
            await self.resync(current_seq=None)
        else:
            self._metrics.event_replays.inc()
            log.info(
                "%s: %d batch(es) missed by the live stream recovered by replay up to seq %d",
                self.replica,
                applied,
                self.next_seq - 1,
            )
        self._replay_only += 1
        if self._replay_only == REPLAY_ONLY_WARN_AFTER:
            src, lag = self.source, self._pace.period()
            endpoint = None if src.port is None else src.endpoint(src.port)
            hint = replay_only_hint(endpoint, src.topic, self._replay_only, lag)
            log.warning("%s: %s", self.replica, hint)

    async def _apply(self, seq: int, payload: bytes) -> None:
        loop = asyncio.get_running_loop()
        done = await loop.run_in_executor(
            INGEST, ingest_batch, self.index, self.replica, self.ns, self.source.rank, seq, payload
        )
        # Only now: whoever reads last_seq (/kvgate/index, tests) finds the batch in the index.
        self.next_seq = seq + 1
        self._metrics.ingest_seconds.inc(done.cpu_seconds)
        if done.stamped_at is not None:  # the worker's clock: meaningful where clocks agree
            self._metrics.event_lag.observe(max(time.time() - done.stamped_at, 0.0))
        self._metrics.events_applied.labels(self.name).inc(done.applied)
        if done.unknown_parents:
            self._metrics.skipped_unknown_parent.inc(done.unknown_parents)
        for reason in done.errors:
            self._count_error(reason, seq)

    def _count_error(self, reason: str, seq: int) -> None:
        self._metrics.event_errors.labels(reason).inc()
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            log.warning(
                "%s: skipped malformed KV-event data (%s) in batch %d; further ones are only "
                "counted in kvgate_event_errors_total",
                self.replica,
                reason,
                seq,
            )

    async def _replayed(self) -> list[tuple[int, bytes]] | None:
        """The worker's buffered batches from next_seq on; None when it cannot tell us."""
        if self._replay is None:
            return None
        return await self._replay.fetch(self.next_seq)

    async def _apply_run(self, batches: list[tuple[int, bytes]]) -> int | None:
        """Apply the batches that continue next_seq; None if the buffer starts after it."""
        if batches and batches[0][0] > self.next_seq:
            log.warning(
                "%s: replay buffer starts at seq %d, after the missing %d",
                self.replica,
                batches[0][0],
                self.next_seq,
            )
            return None
        applied = 0
        for seq, payload in batches:
            if seq == self.next_seq:
                await self._apply(seq, payload)
                applied += 1
        return applied

    async def resync(self, current_seq: int | None) -> None:
        """Drop this replica's entries; rebuild them from the snapshot and the replay buffer.

        A worker without a snapshot (plain vLLM) is rebuilt from its replay buffer alone, from
        the oldest batch it still holds: blocks stored before that stay unknown (their children
        are skipped, never mis-keyed) until stored again. Without a replay endpoint either, it
        starts empty at the current batch.
        """
        self._metrics.event_resyncs.inc()
        self.index.drop_replica(self.replica)
        snap = await fetch_snapshot(self.source, self._http, self.replica)
        if snap is not None:
            await asyncio.get_running_loop().run_in_executor(INGEST, self.load_snapshot, snap)
        else:
            self.next_seq = 0
        batches = await self._replayed()
        if batches is None:
            if snap is None:
                self.next_seq = current_seq if current_seq is not None else 0
            return
        if snap is None and batches and batches[0][0] > 0:
            log.info(
                "%s: no snapshot and replay history starts at seq %d; earlier blocks stay "
                "unknown until stored again",
                self.replica,
                batches[0][0],
            )
            self.next_seq = batches[0][0]
        await self._apply_run(batches)

    def load_snapshot(self, snap: Snapshot) -> None:
        applied = sum(self.index.store(self.replica, self.ns, ev) for ev in snap.stored_events())
        self._metrics.events_applied.labels(self.name).inc(applied)
        self.next_seq = snap.seq + 1 if snap.seq is not None else 0
