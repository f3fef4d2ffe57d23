"""Connect mode: one SUB that the gateway binds and that vLLM workers' publishers connect to.

With `--kv-events-bind tcp://*:PORT`, plain vLLM workers are run with a non-wildcard `endpoint`
in their --kv-events-config (`tcp://<gateway>:PORT`): vLLM then connects its PUB instead of
binding it, as it does for llm-d's central subscriber. vLLM offsets that port by the rank too,
so rank r connects to PORT + r: the hub binds each rank's port as ranks appear. One SUB takes
every worker's batches; the hub hands each to the subscriber of its (topic, data-parallel rank),
so each worker needs a topic of its own. Batches of a topic and rank no subscriber follows (yet)
are dropped and counted (`kvgate_event_errors_total{reason="unknown_topic"}`); the subscriber
that starts later rebuilds them from the worker's replay buffer.

Why replay still matters here: a bound SUB attaches a new incoming connection, and sends that
publisher its subscription, only when the SUB's own thread next calls into the socket; until the
subscription arrives the PUB has no subscriber and drops every batch (vLLM's publisher in
connect mode, recorded in tests/fixtures/vllm_0_33/connect_mode/). The hub polls its SUB all the
time, so that window is short, but the first batches of every new publisher connection fall into
it. Each subscriber still asks its worker's replay ROUTER (which vLLM always binds) for what the
live stream missed: at start, on a seq gap, and after every idle interval (the tail check).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from cachekey.events import peek_rank
from cachekey.events import seq_from_bytes as seq_of
from gateway.discovery.endpoints import parse_bind
from gateway.metrics import GatewayMetrics
from gateway.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Inbox = asyncio.Queue[tuple[int, bytes]]
INBOX_BATCHES = 100_000  # as a SUB's receive high-water mark: past it, batches drop (a gap)


class EventHub:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, metrics: GatewayMetrics) -> None:
        self._base, self._port = parse_bind(endpoint)
        self._metrics = metrics
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.IPV6, ":" in self._base)
        self._sub.subscribe(b"")
        self._bound: set[int] = set()
        self._routes: dict[tuple[bytes, int], Inbox] = {}
        self._unknown: set[tuple[bytes, int]] = set()
        self._task: asyncio.Task | None = None
        self.bind_rank(0)

    def endpoint(self, rank: int) -> str:
        return f"{self._base}:{self._port + rank}"

    def bind_rank(self, rank: int) -> None:
        """Bind the port rank `rank`'s publishers connect to (vLLM: PORT + rank)."""
        if rank not in self._bound:
            try:
                self._sub.bind(self.endpoint(rank))
            except zmq.ZMQError as e:
                raise OSError(f"--kv-events-bind: cannot bind {self.endpoint(rank)}: {e}") from None
            self._bound.add(rank)
            log.info("KV events: central SUB bound at %s", self.endpoint(rank))

    def register(self, topic: str, rank: int | None) -> Inbox:
        """The inbox of one (topic, rank); ValueError when another subscriber follows it."""
        key = (topic.encode(), rank or 0)
        if key in self._routes:
            raise ValueError(
                f"two workers publish KV events on topic {topic!r} rank {rank or 0}: in connect "
                "mode each needs its own topic (kv-topic=, or {host}/{pod} in the topic)"
            )
        self.bind_rank(rank or 0)
        inbox = self._routes[key] = asyncio.Queue(INBOX_BATCHES)
        self._unknown.discard(key)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kv-event-hub")
        return inbox

    def unregister(self, topic: str, rank: int | None, inbox: Inbox) -> None:
        key = (topic.encode(), rank or 0)
        if self._routes.get(key) is inbox:
            del self._routes[key]

    async def _run(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self._metrics.event_errors.labels("bad_frames").inc()
                continue
            topic, raw_seq, payload = frames
            key = (topic, peek_rank(payload) or 0)
            inbox = self._routes.get(key)
            if inbox is None:
                self._drop_unknown(key)
                continue
            with contextlib.suppress(asyncio.QueueFull):  # the subscriber will see a gap
                inbox.put_nowait((seq_of(raw_seq), payload))

    def _drop_unknown(self, key: tuple[bytes, int]) -> None:
        self._metrics.event_errors.labels("unknown_topic").inc()
        if key not in self._unknown and len(self._unknown) < 1024:  # logged once each
            self._unknown.add(key)
            log.warning(
                "KV events for topic %r rank %d, which no worker is known to publish (yet): "
                "dropped; a worker that appears later is rebuilt from its replay buffer",
                key[0].decode(errors="replace"),
                key[1],
            )

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._sub.close(linger=0)
