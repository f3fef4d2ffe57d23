"""Replicas: the workers behind the gateway, their health and load view.

A replica is one data-parallel rank of one worker base URL (gateway/fleet/ranks.py): a worker
serving one rank is one replica whose id is its URL; one serving several is one replica per rank,
the first keeping the URL as its id and rank r being `URL#dp<r>`. Each URL has one poller task (on
its first replica, the "head") reading /kvgate/info, /health and /metrics every `poll_interval`
(longer past `max_polls_per_second` workers per second, gateway/pace.py):
the info gives the instance id and the ranks (a change means a restarted worker: its index
entries are dropped and new event subscribers, one per rank, reload them), /metrics gives each
rank's queue and KV usage (vLLM's `engine` label). The gateway's own in-flight count
(`Replica.in_flight`, the one counter admission, policies and metrics read) is kept by admission
on the request path. A replica that is not available says why (`health.down_reason`); the
gateway logs it, and names it in its 503s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

import httpx

from cachekey.documents import DocumentError, WorkerInfo, decode_document
from cachekey.worker_auth import CurveKeys, bearer
from gateway.config import GatewayConfig
from gateway.discovery.endpoints import WorkerEndpoint
from gateway.events.followers import EventFollowers, event_context
from gateway.fleet.copy_rate import parse_copy_sums
from gateway.fleet.health import ReplicaHealth, refusal
from gateway.fleet.health_state import NOT_POLLED
from gateway.fleet.link import ReplicaLink
from gateway.fleet.parity import check_parity
from gateway.fleet.prefill_rate import parse_prefill_sums
from gateway.fleet.ranks import RankSlot, parse_engine_load, rank_loras, rank_slots, worker_layout
from gateway.fleet.replica import Replica
from gateway.fleet.vllm_compat import vllm_info
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.names import ReplicaId, replica_name
from gateway.pace import Pace
from gateway.tasks import cancel_and_wait
from gateway.upstream.pool import Fetched, UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

START_CHECK_S = 0.05  # how often a request waiting for the first polls looks again


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
        self._zmq = event_context()
        self._ssl = httpx.create_ssl_context()  # built once: loading CA files costs ~0.1 s
        token = config.worker_token
        self._curve = CurveKeys.from_token(token) if token else None
        self.replicas: dict[ReplicaId, Replica] = {}
        self._heads: dict[str, Replica] = {}  # URL -> the replica polling it
        self.discovered = False  # set by discovery's first answer
        self.started = False  # every worker polled once, at least once (`known`)
        self._poll_pace = Pace(config.poll_interval, config.max_polls_per_second)
        self.changed = asyncio.Event()
        self.events = EventFollowers(config, index, metrics, http, self._zmq, self._curve)
        self.health = ReplicaHealth(config, metrics, index, self.changed, self.events.stop)

    # ---- membership ------------------------------------------------------------------------

    @property
    def known(self) -> bool:
        """Whether the gateway knows its workers' state, good or bad: discovery has answered and
        each worker has been polled once (the gateway's readiness, `/ready`)."""
        known = self.discovered and all(
            r.healthy or r.health.down_reason != NOT_POLLED for r in self._heads.values()
        )
        self.started |= known
        return known

    async def wait_started(self, timeout: float) -> None:
        """Until the gateway has known its workers' state once (`known`), at most `timeout` s.
        A request that reaches a gateway still polling its workers for the first time (a
        restart, or a client or balancer that does not read `/ready`) waits for those polls
        rather than be refused for a state the gateway has not read yet. Once started the
        gateway stays so: a worker discovered later is never waited for."""
        deadline = time.monotonic() + timeout
        while not self.known and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(START_CHECK_S, left))

    async def set_workers(self, workers: frozenset[WorkerEndpoint]) -> None:
        """Discovery callback: the full current set of workers."""
        self.discovered = True
        wanted = {w.url.rstrip("/"): w for w in workers}
        for url in [u for u in self._heads if u not in wanted]:
            await self._remove(self._heads[url])
        for url, endpoint in wanted.items():
            head = self._heads.get(url)
            if head is not None and head.endpoint != endpoint:
                await self._remove(head)  # its events endpoints moved: start over
                head = None
            if head is None:
                rid = ReplicaId(url)
                rep = self._new_replica(rid, url, endpoint, self._new_pool(url))
                self.replicas[rid] = self._heads[url] = rep
                self._poll_pace.join()
                rep.link.poll_task = asyncio.create_task(self._poll_loop(rep))
                self.metrics.replica_healthy.labels(rep.name).set(0)

    async def _remove(self, head: Replica) -> None:
        if self._heads.get(head.url) is head:
            del self._heads[head.url]
            self._poll_pace.leave()
        await cancel_and_wait(head.link.poll_task)
        for rep in head.ranks:
            await self._forget(rep)
        if head.link.pool is not None:
            await head.link.pool.close()

    async def _forget(self, rep: Replica) -> None:
        """Take one replica out: its subscriber, index entries and metrics."""
        if self.replicas.get(rep.id) is rep:
            del self.replicas[rep.id]
        await self.events.stop(rep)
        self.index.drop_replica(rep.id)
        for g in (self.metrics.replica_healthy, self.metrics.parity_mismatch):
            with contextlib.suppress(KeyError):
                g.remove(rep.name)

    async def close(self) -> None:
        siblings = {id(s) for r in self.replicas.values() for s in r.siblings}
        for head in [r for r in self.replicas.values() if id(r) not in siblings]:
            await self._remove(head)
        await self.events.close()
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

    def __iter__(self) -> Iterator[Replica]:
        """Every replica, available or not."""
        return iter(self.replicas.values())

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
        if not reps and self.replicas:  # workers there are; none serves `model`
            return "none of the known workers served it at their last poll"
        if not reps:
            return "no worker is configured (--workers or --discovery k8s)"
        return "; ".join(r.describe(now) for r in reps)

    # ---- polling ---------------------------------------------------------------------------

    async def _poll_loop(self, rep: Replica) -> None:
        """Poll at once, then every poll period (gateway/pace.py: --poll-interval, stretched
        past --max-polls-per-second), from a random phase."""
        delay = self._poll_pace.first_delay
        while True:
            try:
                await self.poll_once(rep)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a poll must never kill the loop
                log.warning("poll %s failed: %s", rep.where, e)
            await asyncio.sleep(delay())
            delay = self._poll_pace.delay

    async def poll_once(self, rep: Replica) -> None:
        """One poll of a worker: /kvgate/info, /health and /metrics, one after the other on
        one kept-alive connection of its pool (the request path's), within twice the connect
        timeout: a connection, and answers that are small."""
        if rep.link.pool is None:
            rep.link.pool = self._new_pool(rep.url)
        pool = rep.link.pool
        try:
            async with asyncio.timeout(2 * self.config.connect_timeout):
                info_r = await pool.fetch("/kvgate/info")
                health_r = await pool.fetch("/health")
                metrics_r = await pool.fetch("/metrics")
        except TimeoutError:
            await self.health.unreachable(rep, f"no answer in {2 * self.config.connect_timeout:g}s")
            return
        except UpstreamError as e:  # the cause's type only: clients see it, never the address
            await self.health.unreachable(rep, type(e.__cause__ or e).__name__)
            return
        rep.health.failed_polls = 0
        info = self._read_info(rep, info_r)
        if info is None and info_r.status == 404 and health_r.status == 200:
            info = await vllm_info(self._http, rep.url, metrics_r.text, self.config, rep.endpoint)
        if info is None:
            reason = rep.health.info_error or refusal(info_r)
            await self.health.mark_down(rep, reason)
            return
        if info.instance_id != rep.instance_id or worker_layout(info) != worker_layout(rep.info):
            await self._new_instance(rep, info)
        for r, lora in zip(rep.ranks, rank_loras(info), strict=False):
            r.lora = lora  # adapters come and go without a restart
        if metrics_r.status == 200:
            self._set_load(rep, parse_engine_load(metrics_r.text))
            sums = parse_prefill_sums(metrics_r.text)  # the worker's, shared by its ranks
            copies = parse_copy_sums(metrics_r.text)
            for r in rep.ranks:
                r.prefill_rate.observe(sums)
                r.copy_rate.observe(copies)
        for r in rep.ranks:
            self.health.set_health(r, health_r)

    def _set_load(self, head: Replica, loads: dict[str | None, dict[str, float]]) -> None:
        """Each rank's gauges (its `engine` label); one rank alone takes the sum if unlabelled."""
        for rep in head.ranks:
            engine = rep.slot.engine if rep.slot is not None else None
            load = loads.get(engine) or (loads[None] if not head.siblings else None)
            for attr, value in (load or {}).items():
                setattr(rep, attr, value)
            rep.count_foreign()

    def _read_info(self, rep: Replica, resp: Fetched) -> WorkerInfo | None:
        if resp.status != 200:
            return None
        try:
            info = decode_document(resp.body, WorkerInfo)
        except DocumentError as e:
            if str(e) != rep.health.info_error:
                log.error("replica %s is not usable: %s", rep.where, e)
            rep.health.info_error = str(e)
            return None
        rep.health.info_error = None
        return info

    async def _new_instance(self, head: Replica, info: WorkerInfo) -> None:
        """A (re)started worker: one replica per rank, each with a new event subscriber."""
        if head.instance_id is not None:
            log.info("replica %s restarted (new instance %s)", head.where, info.instance_id)
        slots = rank_slots(info)
        reps = [head, *(self._sibling(head, slot) for slot in slots[1:])]
        for old in head.siblings:
            if old not in reps:
                await self._forget(old)
        head.siblings = reps[1:]
        for rep, slot in zip(reps, slots, strict=True):
            await self.events.stop(rep)
            self.index.drop_replica(rep.id)
            rep.info, rep.slot = info, slot
            rep.instance_id = info.instance_id
            rep.model = info.model
            rep.dp_rank, rep.rank_header = slot.rank, slot.header
            rep.fingerprint = info.fingerprint
            rep.namespace = info.namespace()
            rep.prefill_rate.reset()
            rep.copy_rate.reset()
            self.index.set_traits(rep.id, info.defers_shared_prefill, slot.num_blocks)
        check_parity(self.replicas.values(), self.metrics)
        for rep in reps:
            self.events.start(rep)

    def _new_replica(
        self, rid: ReplicaId, url: str, endpoint: WorkerEndpoint | None, pool: UpstreamPool | None
    ) -> Replica:
        pod = endpoint.pod if endpoint is not None else None
        name = replica_name(rid, self.config.worker_token, pod)  # each rank has its own
        return Replica(id=rid, url=url, name=name, endpoint=endpoint, link=ReplicaLink(pool=pool))

    def _sibling(self, head: Replica, slot: RankSlot) -> Replica:
        rid = ReplicaId(f"{head.url}#dp{slot.rank}")
        rep = next((r for r in head.siblings if r.id == rid), None)
        if rep is None:
            rep = self._new_replica(rid, head.url, head.endpoint, head.link.pool)
            rep.healthy, rep.health.down_reason = head.healthy, head.health.down_reason
            self.metrics.replica_healthy.labels(rep.name).set(1 if rep.healthy else 0)
        self.replicas[rid] = rep
        return rep
