"""Replicas: the workers behind the gateway, their health and load view.

A replica is one worker base URL (plus its data-parallel rank from /kvgate/info). Each replica
has one poller task reading /kvgate/info, /health and /metrics every `poll_interval`: the info
gives the instance id (a change means a restarted worker: its index entries are dropped and a
new event subscriber reloads them), /metrics gives the queue and KV usage. The gateway's own
in-flight count (`Replica.in_flight`, the one counter admission, policies and metrics read) is
kept by admission on the request path. A replica that is not available says why
(`down_reason`); the gateway logs it, and names it in its 503s.
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

from cachekey.documents import DocumentError, LoRAAdapters, WorkerInfo, decode_document
from cachekey.keys import HashNamespace
from cachekey.worker_auth import CurveKeys, bearer
from gateway.config import GatewayConfig
from gateway.index import BlockIndex, ReplicaId
from gateway.metrics import GatewayMetrics
from gateway.parity import check_parity
from gateway.prefill_rate import PrefillRate, parse_prefill_sums
from gateway.replica_names import replica_name
from gateway.subscriber import EventSource, KVEventSubscriber
from gateway.upstream import UpstreamPool
from gateway.vllm_compat import vllm_info

log = logging.getLogger(__name__)

_REWARN_SECONDS = 30.0  # how often an unreachable worker is logged again

_LOAD_GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


@dataclass(slots=True)
class Replica:
    id: ReplicaId
    url: str
    name: str = ""  # what clients see (x-kvgate-replica): never the URL (replica_names.py)
    dp_rank: int | None = None
    instance_id: str | None = None
    model: str | None = None
    fingerprint: str | None = None
    namespace: HashNamespace | None = None
    info: WorkerInfo | None = None
    info_error: str | None = None  # why its last /kvgate/info was refused (logged once)
    healthy: bool = False
    parity_ok: bool = True
    down_reason: str | None = "not polled yet"  # why it is not healthy (None when it is)
    warned_at: float | None = None  # last time its being down was logged
    # Load view: worker-reported (polled) and the gateway's own accounting.
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    in_flight: int = 0
    # Uncached prompt tokens of this gateway's requests here that have no first token yet.
    in_flight_prefill_tokens: int = 0
    prefill_rate: PrefillRate = field(default_factory=PrefillRate)  # from the worker's metrics
    # LoRA adapters it serves (polled), and when the gateway last sent it each one (adapters.py).
    lora: LoRAAdapters | None = None
    lora_routed: dict[str, float] = field(default_factory=dict)
    # Uncached prefill tokens routed here, exponentially decayed: spreads new prefix groups
    # over replicas even when nothing is in flight (a sequential trace).
    recent_prefill: float = 0.0
    recent_at: float = 0.0
    # Circuit breaker (gateway/breaker.py).
    failures: int = 0
    ejected_until: float = 0.0
    # Keep-alive connections for requests; the pollers' traffic goes through httpx.
    pool: UpstreamPool | None = field(default=None, repr=False)
    subscriber: KVEventSubscriber | None = field(default=None, repr=False)
    poll_task: asyncio.Task | None = field(default=None, repr=False)
    sub_task: asyncio.Task | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.name:  # ReplicaSet names its replicas with the worker token as key
            self.name = replica_name(self.id, None)

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until

    def recent_prefill_at(self, now: float, half_life: float) -> float:
        return self.recent_prefill * 0.5 ** ((now - self.recent_at) / half_life)

    def add_recent_prefill(self, tokens: int, now: float, half_life: float) -> None:
        self.recent_prefill = self.recent_prefill_at(now, half_life) + tokens
        self.recent_at = now

    def describe(self, now: float) -> str:
        """`name (why it takes no traffic)`, or `name (healthy...)`: for clients, so no URL."""
        if self.available(now):
            state = "healthy" if self.parity_ok else "healthy, parity mismatch: routed by load only"
        elif now < self.ejected_until:
            state = self.down_reason or "ejected"
        else:
            state = self.down_reason or "unhealthy"
        return f"{self.name} ({state})"


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


def _reason(resp: httpx.Response) -> str:
    """The message of a worker's error body, else the start of its text."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200] or resp.reason_phrase


def _refusal(info_r: httpx.Response) -> str:
    if info_r.status_code == 401:
        return "/kvgate/info answered 401: the worker does not take this gateway's worker token"
    return f"/kvgate/info answered {info_r.status_code}"


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
        token = config.worker_token
        self._curve = CurveKeys.from_token(token) if token else None
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
                name = replica_name(rid, self.config.worker_token)
                rep = self.replicas[rid] = Replica(rid, url, name, pool=self._new_pool(url))
                rep.poll_task = asyncio.create_task(self._poll_loop(rep))
                self.metrics.replica_healthy.labels(rid).set(0)

    async def _remove(self, rid: ReplicaId) -> None:
        rep = self.replicas.pop(rid)
        await self._stop_subscriber(rep)
        await _cancel(rep.poll_task)
        if rep.pool is not None:
            await rep.pool.close()
        self.index.drop_replica(rid)
        for g in (self.metrics.replica_healthy, self.metrics.parity_mismatch):
            with contextlib.suppress(KeyError):
                g.remove(rid)

    async def close(self) -> None:
        for rid in list(self.replicas):
            await self._remove(rid)
        self._zmq.destroy(linger=0)

    def _new_pool(self, url: str) -> UpstreamPool:
        c = self.config
        return UpstreamPool(
            url,
            connect_timeout=c.connect_timeout,
            read_timeout=c.request_timeout,
            ssl_context=self._ssl,
            authorization=bearer(c.worker_token) if c.worker_token else None,
        )

    # ---- views -----------------------------------------------------------------------------

    def available(self) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self.replicas.values() if r.available(now)]

    def describe(self, model: str | None = None) -> str:
        """Every replica (of `model`, when given) and its state, for error messages."""
        now = time.monotonic()
        reps = [
            r
            for r in self.replicas.values()
            if model is None
            or r.model in (model, None)
            or (r.lora is not None and model in r.lora.adapters)
        ]
        if not reps:
            return "no worker is configured (--workers or --discovery k8s)"
        return "; ".join(r.describe(now) for r in reps)

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
        except httpx.HTTPError as e:
            await self._mark_down(rep, f"unreachable: {type(e).__name__}: {e}".rstrip(": "))
            return
        info = self._read_info(rep, info_r)
        if info is None and info_r.status_code == 404 and health_r.status_code == 200:
            info = await vllm_info(self._http, rep.url, metrics_r.text, self.config)
        if info is None:
            reason = rep.info_error or _refusal(info_r)
            await self._mark_down(rep, reason)
            return
        if info.instance_id != rep.instance_id:
            await self._new_instance(rep, info)
        rep.lora = info.lora  # adapters come and go without a restart
        if metrics_r.status_code == 200:
            for attr, value in parse_load(metrics_r.text).items():
                setattr(rep, attr, value)
            rep.prefill_rate.observe(parse_prefill_sums(metrics_r.text))
        self._set_health(rep, health_r)

    def _set_health(self, rep: Replica, health_r: httpx.Response) -> None:
        ejected = time.monotonic() < rep.ejected_until
        healthy = health_r.status_code == 200 and not ejected
        if not healthy and not ejected:
            rep.down_reason = f"/health {health_r.status_code}: {_reason(health_r)}"
        if healthy != rep.healthy:
            if healthy:
                log.info("replica %s healthy", rep.id)
            else:
                log.warning("replica %s unhealthy: %s", rep.id, rep.down_reason)
            rep.healthy = healthy
            rep.down_reason = None if healthy else rep.down_reason
            rep.warned_at = time.monotonic()
            self.changed.set()
        elif not healthy:
            self._warn_down(rep)
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

    async def _mark_down(self, rep: Replica, reason: str) -> None:
        was_up = rep.healthy or rep.instance_id is not None
        rep.down_reason = reason
        if was_up:
            log.warning("replica %s %s; dropping its index entries", rep.id, reason)
            rep.warned_at = time.monotonic()
        else:
            self._warn_down(rep)
        rep.healthy = False
        rep.instance_id = None
        self.metrics.replica_healthy.labels(rep.id).set(0)
        await self._stop_subscriber(rep)
        self.index.drop_replica(rep.id)

    def _warn_down(self, rep: Replica) -> None:
        """Log a replica that is down at once, then every _REWARN_SECONDS while it stays down."""
        now = time.monotonic()
        if rep.warned_at is None or now - rep.warned_at >= _REWARN_SECONDS:
            rep.warned_at = now
            log.warning("worker %s takes no traffic: %s", rep.url, rep.down_reason)

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
        rep.prefill_rate.reset()
        self.index.set_traits(rep.id, info.defers_shared_prefill, info.num_blocks)
        check_parity(self.replicas.values(), self.metrics)
        kv = info.kv_events
        if kv.enabled and kv.port is not None and self.config.kv_events:
            source = EventSource(
                instance_id=info.instance_id,
                host=urlparse(rep.url).hostname or "127.0.0.1",
                port=kv.port,
                replay_port=kv.replay_port,
                topic=kv.topic,
                snapshot_url=f"{rep.url}/kv/snapshot" if info.has_snapshot else None,
                curve=self._curve if kv.curve else None,
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
