"""GatewayState: everything one gateway app owns, built in one place (`app.create_app`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from cachekey.bodies import BodyBudget, budget_bytes
from cachekey.render import Renderer
from cachekey.worker_auth import CurveKeys, bearer
from gateway.assets import load_assets
from gateway.config import GatewayConfig
from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.replica_set import ReplicaSet
from gateway.images.fetch import ImageFetcher, RemoteImagesDisabled
from gateway.images.guard import AllowList, FetchPolicy
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.peers.link import PeerLink
from gateway.peers.outbox import PeerOutbox
from gateway.peers.shares import PeerShares
from gateway.peers.view import PeerView
from gateway.quarantine import Quarantine
from gateway.routing.admission import Admission, RenderQueue
from gateway.routing.policies import POLICIES, Policy
from gateway.routing.tenants import TenantRegistry
from kvgate_cli.drain import OpenStreams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    metrics: GatewayMetrics
    index: BlockIndex
    http: httpx.AsyncClient
    replicas: ReplicaSet
    policies: dict[str, Policy]
    fetcher: ImageFetcher | RemoteImagesDisabled
    admission: Admission
    breaker: CircuitBreaker
    render_queue: RenderQueue
    quarantine: Quarantine  # requests that killed engines (gateway/quarantine.py)
    bodies: BodyBudget  # the bytes of the request bodies being read (gateway/limits.py)
    tenants: TenantRegistry | None = None  # None: no API keys, no tenant salts
    peers: PeerOutbox | None = None  # None: no peer gateways (--peer-port)
    peer_link: PeerLink | None = None
    renderer: object | None = None
    streams: OpenStreams = field(default_factory=OpenStreams)  # what a drain cuts
    _assets_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def build(cls, config: GatewayConfig, streams: OpenStreams | None = None) -> GatewayState:
        metrics = GatewayMetrics()
        index = BlockIndex(config.index_max_blocks, config.speculative_ttl)
        # Control traffic (polls, snapshots, assets); requests use each replica's own pool.
        # Only workers are ever called through it, so it carries the worker token on every call.
        token = config.worker_token
        http = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0, connect=config.connect_timeout),
            headers={"authorization": bearer(token)} if token else None,
        )
        replicas = ReplicaSet(config, index, metrics, http)
        lim = config.limits
        metrics.in_flight.source = lambda: (
            (
                r.name,
                r.id,
                r.in_flight,
                r.in_flight_tokens,
                (r.prefill_rate.seconds_per_token, r.copy_rate.seconds_per_token),
                r.latency,
            )
            for r in replicas
        )
        state = cls(
            config=config,
            metrics=metrics,
            index=index,
            http=http,
            replicas=replicas,
            policies={name: ctor(config) for name, ctor in POLICIES.items()},
            fetcher=_build_fetcher(config),
            admission=Admission(config),
            breaker=CircuitBreaker(config, metrics),
            render_queue=RenderQueue(4, config.max_render_queue),
            quarantine=Quarantine(config.poison_ttl),
            bodies=BodyBudget(budget_bytes(lim.body_read_budget, lim.max_body_bytes)),
            tenants=(
                TenantRegistry(config.api_keys_file, config.tenant_salt_secret)
                if config.api_keys_file
                else None
            ),
            streams=OpenStreams() if streams is None else streams,
        )
        if config.peer_port is not None:
            state.peers, state.peer_link = _build_peers(state)
        return state

    async def get_renderer(self):
        """The Renderer, loading the assets on first use (from --model-dir or a worker)."""
        if self.renderer is not None:
            return self.renderer
        async with self._assets_lock:
            if self.renderer is None:
                urls = [r.url for r in self.replicas if r.instance_id]
                assets = await load_assets(self.config.model_dir, urls, self.http)
                limits = self.config.limits.render_limits()
                self.renderer = Renderer(assets, fetcher=self.fetcher, limits=limits)
                self._check_assets(assets.fingerprint())
        return self.renderer

    def _check_assets(self, fingerprint: str) -> None:
        """Local --model-dir assets must be the workers' assets, or no key would ever match."""
        theirs = {
            r.info.fingerprint_parts.assets
            for r in self.replicas
            if r.info is not None and r.info.fingerprint_parts is not None
        }
        ok = not theirs or fingerprint in theirs
        self.metrics.parity_mismatch.labels("gateway").set(0 if ok else 1)
        if ok:
            log.info("render assets loaded (fingerprint %s)", fingerprint)
        else:
            log.error(
                "render assets fingerprint %s differs from the workers' %s: predictions will miss",
                fingerprint,
                sorted(theirs),
            )

    async def close(self) -> None:
        if self.peer_link is not None:
            await self.peer_link.stop()
        if self.admission.shares is not None:
            self.admission.shares.close()
        await self.replicas.close()
        await self.http.aclose()
        self.fetcher.close()
        self.render_queue.close()


def _build_peers(state: GatewayState) -> tuple[PeerOutbox, PeerLink]:
    c = state.config
    assert c.peer_port is not None
    replicas, wake = (lambda: state.replicas.replicas), state.admission.wake
    view = PeerView(state.index, replicas, c.peer_timeout, wake, c.recent_half_life)
    outbox = PeerOutbox()
    curve = CurveKeys.from_token(c.worker_token) if c.worker_token else None
    link = PeerLink(c.host, c.peer_port, c.peers, view, outbox, state.metrics, curve)
    admission = state.admission
    view.own_demand = admission.demand
    if c.peer_admission == "shares" and admission.cap is not None:
        nudge, wake = outbox.ready.set, admission.wake
        admission.shares = PeerShares(view, link.sender, admission.cap, nudge, wake)
    return outbox, link


def _build_fetcher(config: GatewayConfig) -> ImageFetcher | RemoteImagesDisabled:
    if not config.remote_images:
        return RemoteImagesDisabled()
    policy = FetchPolicy(AllowList.parse(config.image_fetch_allow))
    return ImageFetcher(
        config.limits.max_image_bytes,
        config.image_fetch_timeout,
        policy,
        max_total_bytes=config.image_fetch_max_bytes,
    )
