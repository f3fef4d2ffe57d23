"""Following the KV events of each replica (one data-parallel rank of a worker).

Bind mode (the default): each rank's subscriber connects its own SUB to the rank's PUB. Connect
mode (`--kv-events-bind`, plain vLLM workers only): each rank's subscriber reads an inbox of the
central SUB (gateway/events/event_hub.py). Either way it replays and resyncs through the rank's own
replay endpoint and snapshot (gateway/events/subscriber.py).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Protocol
from urllib.parse import urlparse

import httpx
import zmq.asyncio

from cachekey.documents import KVEventsEndpoint, WorkerInfo
from cachekey.keys import HashNamespace
from cachekey.worker_auth import CurveKeys
from gateway.config import GatewayConfig
from gateway.discovery.endpoints import WorkerEndpoint
from gateway.events.event_hub import EventHub
from gateway.events.event_source import EventSource
from gateway.events.subscriber import KVEventSubscriber
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.names import VLLM_INSTANCE, ReplicaId
from gateway.pace import Pace
from gateway.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def event_context() -> zmq.asyncio.Context:
    """The gateway's ZMQ context. libzmq caps a context at 1023 sockets by default, which stops
    at 511 workers (a SUB and a replay DEALER each): the open-files limit is the real bound."""
    ctx = zmq.asyncio.Context()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    ctx.MAX_SOCKETS = 1 << 16 if soft == resource.RLIM_INFINITY else max(1023, min(soft, 1 << 20))
    return ctx


class FollowedSlot(Protocol):
    """Where one rank publishes (gateway.fleet.ranks.RankSlot)."""

    @property
    def rank(self) -> int | None: ...
    @property
    def kv_events(self) -> KVEventsEndpoint: ...
    @property
    def snapshot_path(self) -> str | None: ...


class FollowerLink(Protocol):
    """Where a replica keeps its subscriber and the task running it
    (gateway.fleet.link.ReplicaLink)."""

    subscriber: KVEventSubscriber | None
    sub_task: asyncio.Task | None


class FollowedReplica(Protocol):
    """What following a replica's events reads and sets (gateway.fleet.replica.Replica): the
    transport speaks to replicas only through this, never through gateway/fleet/."""

    id: ReplicaId
    name: str  # its metrics' label
    url: str
    endpoint: WorkerEndpoint | None
    info: WorkerInfo | None
    namespace: HashNamespace | None

    @property
    def where(self) -> str: ...  # `name (url)`, for the log
    @property
    def slot(self) -> FollowedSlot | None: ...
    @property
    def link(self) -> FollowerLink: ...


class EventFollowers:
    """Starts and stops each replica's subscriber; owns the central SUB in connect mode."""

    def __init__(
        self,
        config: GatewayConfig,
        index: BlockIndex,
        metrics: GatewayMetrics,
        http: httpx.AsyncClient,
        zmq_ctx: zmq.asyncio.Context,
        curve: CurveKeys | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.metrics = metrics
        self._http = http
        self._zmq = zmq_ctx
        self._curve = curve  # the worker token's keys, for the ranks whose sockets use CURVE
        self.hub = (
            EventHub(zmq_ctx, config.kv_events_bind, metrics) if config.kv_events_bind else None
        )
        # One pace for every subscriber's tail checks (gateway/pace.py).
        self._tail_pace = Pace(config.event_tail_check_interval, config.max_tail_checks_per_second)

    def start(self, rep: FollowedReplica) -> None:
        """Follow one rank's KV events: its own SUB, or its inbox on the central SUB."""
        info, slot = rep.info, rep.slot
        assert info is not None and slot is not None and rep.namespace is not None
        kv = slot.kv_events
        plain = info.instance_id == VLLM_INSTANCE
        hub = self.hub if plain else None  # connect mode is for plain vLLM workers
        if not kv.enabled or (kv.port is None and hub is None):
            return
        if plain and rep.endpoint is not None:
            host = rep.endpoint.host
        else:
            host = urlparse(rep.url).hostname or "127.0.0.1"
        source = EventSource(
            instance_id=info.instance_id,
            host=host,
            port=None if hub is not None else kv.port,
            replay_port=kv.replay_port,
            topic=kv.topic,
            snapshot_url=f"{rep.url}{slot.snapshot_path}" if slot.snapshot_path else None,
            rank=slot.rank,
            curve=self._curve if kv.curve else None,
        )
        inbox = None
        if hub is not None:
            try:
                inbox = hub.register(kv.topic, slot.rank)
            except (ValueError, OSError) as e:  # a taken topic, or a port we cannot bind
                log.error("replica %s: %s; its index stays empty", rep.where, e)
                return
        sub = KVEventSubscriber(
            rep.id,
            source,
            rep.namespace,
            self.index,
            self._http,
            self._zmq,
            self.metrics,
            tail_check_interval=self._tail_pace,
            inbox=inbox,
            name=rep.name,
        )
        rep.link.subscriber = sub
        self._tail_pace.join()
        rep.link.sub_task = asyncio.create_task(self._run(rep, sub))

    async def _run(self, rep: FollowedReplica, sub: KVEventSubscriber) -> None:
        while rep.link.subscriber is sub:
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("subscriber %s failed: %s; restarting", rep.where, e)
                await asyncio.sleep(self.config.poll_interval)

    async def stop(self, rep: FollowedReplica) -> None:
        sub, rep.link.subscriber = rep.link.subscriber, None
        if sub is not None:
            self._tail_pace.leave()
        task, rep.link.sub_task = rep.link.sub_task, None
        await cancel_and_wait(task)
        if sub is not None and sub.inbox is not None and self.hub is not None:
            self.hub.unregister(sub.source.topic, sub.source.rank, sub.inbox)

    async def close(self) -> None:
        if self.hub is not None:
            await self.hub.close()
