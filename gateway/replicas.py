"""Replicas: the workers behind the gateway, their health, load view and circuit breaker.

A replica is one worker base URL (plus its data-parallel rank from /kvgate/info). Each replica
has one poller task reading /kvgate/info, /health and /metrics every `poll_interval`: the info
gives the instance id (a change means a restarted worker: its index entries are dropped and a
new event subscriber reloads them), /metrics gives the queue and KV usage. The gateway's own
in-flight accounting is updated on the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import zmq.asyncio

from cachekey.documents import DocumentError, WorkerInfo, decode_document
from cachekey.keys import HashNamespace
from gateway.config import GatewayConfig
from gateway.index import BlockIndex, ReplicaId
from gateway.metrics import GatewayMetrics
from gateway.parity import check_parity
from gateway.subscriber import EventSource, KVEventSubscriber
from gateway.vllm_compat import vllm_info

log = logging.getLogger(__name__)

_LOAD_GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


@dataclass(slots=True)
class Replica:
    id: ReplicaId
    url: str
    dp_rank: int | None = None
    instance_id: str | None = None
    model: str | None = None
    fingerprint: str | None = None
    namespace: HashNamespace | None = None
    info: WorkerInfo | None = None
    info_error: str | None = None  # why its last /kvgate/info was refused (logged once)
    healthy: bool = False
    parity_ok: bool = True
    # Load view: worker-reported (polled) and the gateway's own accounting.
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    in_flight: int = 0
    in_flight_prefill_tokens: int = 0
    # Uncached prefill tokens routed here, exponentially decayed: spreads new prefix groups
    # over replicas even when nothing is in flight (a sequential trace).
    recent_prefill: float = 0.0
    recent_at: float = 0.0
    # Circuit breaker.
    failures: int = 0
    ejected_until: float = 0.0
    # Its own pool: httpx scans every pooled connection per request, so one pool per worker
    # keeps that scan short, and the pollers' traffic out of it.
    client: httpx.AsyncClient | None = field(default=None, repr=False)
    subscriber: KVEventSubscriber | None = field(default=None, repr=False)
    poll_task: asyncio.Task | None = field(default=None, repr=False)
    sub_task: asyncio.Task | None = field(default=None, repr=False)

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until

    def recent_prefill_at(self, now: float, half_life: float) -> float:
        return self.recent_prefill * 0.5 ** ((now - self.recent_at) / half_life)

    def add_recent_prefill(self, tokens: int, now: float, half_life: float) -> None:
        self.recent_prefill = self.recent_prefill_at(now, half_life) + tokens
        self.recent_at = now


def parse_load(text: str) -> dict[str, float]:
    """The three load gauges from a vLLM-style /metrics page (summed over label sets)."""
    out = dict.fromkeys(_LOAD_GAUGES.values(), 0.0)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        attr = _LOAD_GAUGES.get(name)
        if attr is not None:
            with contextlib.suppress(ValueError):
                out[attr] += float(line.rsplit(" ", 1)[1])
    return out


async def _cancel(task: asyncio.Task | None) -> None:
    if task is None or task.done() or task is asyncio.current_task():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


class ReplicaSet:
    """Registry of replicas; keeps pollers and event subscribers in step with the worker set."""

    def __init__(
        self,
        config: GatewayConfig,
        index: BlockIndex,
        metrics: GatewayMetrics,
        http: httpx.AsyncClient,
    ) -> None:
        self.config = config
        self.index = index
        self.metrics = metrics
        self._http = http
        self._zmq = zmq.asyncio.Context()
        self._ssl = httpx.create_ssl_context()  # built once: loading CA files costs ~0.1 s
        self.replicas: dict[ReplicaId, Replica] = {}
        self.changed = asyncio.Event()

    # ---- membership ------------------------------------------------------------------------

    async def set_urls(self, urls: frozenset[str]) -> None:
        """Discovery callback: the full current set of worker base URLs."""
        wanted = {ReplicaId(u.rstrip("/")): u.rstrip("/") for u in urls}
        for rid in [r for r in self.replicas if r not in wanted]:
            await self._remove(rid)
        for rid, url in wanted.items():
            if rid not in self.replicas:
                rep = self.replicas[rid] = Replica(id=rid, url=url, client=self._new_client())
                rep.poll_task = asyncio.create_task(self._poll_loop(rep))
                self.metrics.replica_healthy.labels(rid).set(0)

    async def _remove(self, rid: ReplicaId) -> None:
        rep = self.replicas.pop(rid)
        await self._stop_subscriber(rep)
        await _cancel(rep.poll_task)
        if rep.client is not None:
            await rep.client.aclose()
        self.index.drop_replica(rid)
        for g in (self.metrics.replica_healthy, self.metrics.parity_mismatch):
            with contextlib.suppress(KeyError):
                g.remove(rid)

    async def close(self) -> None:
        for rid in list(self.replicas):
            await self._remove(rid)
        self._zmq.destroy(linger=0)

    def _new_client(self) -> httpx.AsyncClient:
        c = self.config
        return httpx.AsyncClient(
            verify=self._ssl,
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
            timeout=httpx.Timeout(c.request_timeout, connect=c.connect_timeout),
        )

    # ---- views -----------------------------------------------------------------------------

    def available(self) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self.replicas.values() if r.available(now)]

    def record_success(self, rep: Replica) -> None:
        rep.failures = 0

    def record_failure(self, rep: Replica) -> None:
        rep.failures += 1
        if rep.failures >= self.config.eject_after_failures:
            log.warning("ejecting %s for %.1fs", rep.id, self.config.eject_seconds)
            rep.ejected_until = time.monotonic() + self.config.eject_seconds
            rep.failures = 0
            rep.healthy = False  # back only after a good /health probe
            self.metrics.replica_healthy.labels(rep.id).set(0)

    # ---- polling ---------------------------------------------------------------------------

    async def _poll_loop(self, rep: Replica) -> None:
        while True:
            try:
                await self.poll_once(rep)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a poll must never kill the loop
                log.warning("poll %s failed: %s", rep.id, e)
            await asyncio.sleep(self.config.poll_interval)

    async def poll_once(self, rep: Replica) -> None:
        t = self.config.connect_timeout
        try:
            info_r, health_r, metrics_r = await asyncio.gather(
                self._http.get(f"{rep.url}/kvgate/info", timeout=t),
                self._http.get(f"{rep.url}/health", timeout=t),
                self._http.get(f"{rep.url}/metrics", timeout=t),
            )
        except httpx.HTTPError:
            await self._mark_down(rep)
            return
        info = self._read_info(rep, info_r)
        if info is None and info_r.status_code == 404 and health_r.status_code == 200:
            info = await vllm_info(self._http, rep.url, metrics_r.text, self.config)
        if info is None:
            await self._mark_down(rep)
            return
        if info.instance_id != rep.instance_id:
            await self._new_instance(rep, info)
        if metrics_r.status_code == 200:
            for attr, value in parse_load(metrics_r.text).items():
                setattr(rep, attr, value)
        healthy = health_r.status_code == 200 and time.monotonic() >= rep.ejected_until
        if healthy != rep.healthy:
            log.info("replica %s healthy=%s", rep.id, healthy)
            rep.healthy = healthy
            self.changed.set()
        self.metrics.replica_healthy.labels(rep.id).set(1 if healthy else 0)

    def _read_info(self, rep: Replica, resp: httpx.Response) -> WorkerInfo | None:
        if resp.status_code != 200:
            return None
        try:
            info = decode_document(resp.content, WorkerInfo)
        except DocumentError as e:
            if str(e) != rep.info_error:
                log.error("replica %s is not usable: %s", rep.id, e)
            rep.info_error = str(e)
            return None
        rep.info_error = None
        return info

    async def _mark_down(self, rep: Replica) -> None:
        if rep.healthy or rep.instance_id is not None:
            log.warning("replica %s unreachable; dropping its index entries", rep.id)
        rep.healthy = False
        rep.instance_id = None
        self.metrics.replica_healthy.labels(rep.id).set(0)
        await self._stop_subscriber(rep)
        self.index.drop_replica(rep.id)

    async def _new_instance(self, rep: Replica, info: WorkerInfo) -> None:
        if rep.instance_id is not None:
            log.info("replica %s restarted (new instance %s)", rep.id, info.instance_id)
        await self._stop_subscriber(rep)
        self.index.drop_replica(rep.id)
        rep.info = info
        rep.instance_id = info.instance_id
        rep.model = info.model
        rep.dp_rank = info.data_parallel_rank
        rep.fingerprint = info.fingerprint
        rep.namespace = info.namespace()
        check_parity(self.replicas.values(), self.metrics)
        kv = info.kv_events
        if kv.enabled and kv.port is not None:
            source = EventSource(
                instance_id=info.instance_id,
                host=urlparse(rep.url).hostname or "127.0.0.1",
                port=kv.port,
                replay_port=kv.replay_port,
                topic=kv.topic,
                snapshot_url=f"{rep.url}/kv/snapshot" if info.has_snapshot else None,
            )
            sub = KVEventSubscriber(
                rep.id,
                source,
                rep.namespace,
                self.index,
                self._http,
                self._zmq,
                self.metrics,
                tail_check_interval=self.config.event_tail_check_interval,
            )
            rep.subscriber = sub
            rep.sub_task = asyncio.create_task(self._run_subscriber(rep, sub))

    async def _run_subscriber(self, rep: Replica, sub: KVEventSubscriber) -> None:
        while rep.subscriber is sub:
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("subscriber %s failed: %s; restarting", rep.id, e)
                await asyncio.sleep(self.config.poll_interval)

    async def _stop_subscriber(self, rep: Replica) -> None:
        rep.subscriber = None
        task, rep.sub_task = rep.sub_task, None
        await _cancel(task)
