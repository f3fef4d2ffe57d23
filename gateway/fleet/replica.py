"""Replica: one data-parallel rank of one worker, as routing sees it (gateway/fleet/replica_set.py
keeps the set of them in step with the workers)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cachekey.documents import LoRAAdapters, WorkerInfo
from cachekey.keys import HashNamespace, MMMatchRule
from gateway.discovery.endpoints import WorkerEndpoint
from gateway.fleet.breaker import Circuit
from gateway.fleet.link import ReplicaLink
from gateway.fleet.names import ReplicaId, replica_name
from gateway.fleet.prefill_rate import PrefillRate
from gateway.fleet.ranks import RankSlot


@dataclass(slots=True)
class Replica:
    id: ReplicaId
    url: str
    name: str = ""  # what clients see (x-kvgate-replica): never the URL (names.py)
    dp_rank: int | None = None  # its global data-parallel rank (None: not data parallel)
    rank_header: int | None = None  # the X-data-parallel-rank a request sends (None: none)
    endpoint: WorkerEndpoint | None = None  # what discovery says about its URL
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
    warned_reason: str | None = None  # the reason logged then
    # Load view: worker-reported (polled) and the gateway's own accounting.
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    in_flight: int = 0
    # Uncached prompt tokens of this gateway's requests here that have no first token yet.
    in_flight_prefill_tokens: int = 0
    prefill_rate: PrefillRate = field(default_factory=PrefillRate)  # from the worker's metrics
    # LoRA adapters it serves (polled), and when the gateway last sent it each one (routing/
    # adapters.py).
    lora: LoRAAdapters | None = None
    lora_routed: dict[str, float] = field(default_factory=dict)
    # Uncached prefill tokens routed here, exponentially decayed: spreads new prefix groups
    # over replicas even when nothing is in flight (a sequential trace).
    recent_prefill: float = 0.0
    recent_at: float = 0.0
    # log2 of recent_prefill at time 0: orders replicas by their decayed recent prefill at any
    # time, without decaying each one (cache_aware ranks hundreds of idle replicas by it).
    recent_key: float = -math.inf
    failed_polls: int = 0  # in a row, on the head replica (gateway/fleet/replica_set.py)
    circuit: Circuit = field(default_factory=Circuit)  # the circuit breaker's (breaker.py)
    link: ReplicaLink = field(default_factory=ReplicaLink, repr=False)  # pool, subscriber, tasks
    # On the head replica of a URL: its other ranks (polled with it, sharing its pool).
    siblings: list[Replica] = field(default_factory=list, repr=False)
    slot: RankSlot | None = field(default=None, repr=False)

    @property
    def mm_match_rule(self) -> MMMatchRule:
        """What its engine reuses of a match that ends inside an image (its /kvgate/info)."""
        return self.info.mm_match_rule if self.info is not None else "clamp"

    @property
    def ranks(self) -> list[Replica]:
        """This head and its siblings: every rank behind its URL."""
        return [self, *self.siblings]

    def __post_init__(self) -> None:
        if not self.name:  # ReplicaSet names its replicas with the worker token as key
            self.name = replica_name(self.id, None)

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.circuit.open_until

    def recent_prefill_at(self, now: float, half_life: float) -> float:
        return self.recent_prefill * 0.5 ** ((now - self.recent_at) / half_life)

    def add_recent_prefill(self, tokens: int, now: float, half_life: float) -> None:
        self.recent_prefill = self.recent_prefill_at(now, half_life) + tokens
        self.recent_at = now
        if self.recent_prefill > 0:
            self.recent_key = math.log2(self.recent_prefill) + now / half_life

    def describe(self, now: float) -> str:
        """`name (why it takes no traffic)`, or `name (healthy...)`: for clients, so no URL."""
        if self.available(now):
            state = "healthy" if self.parity_ok else "healthy, parity mismatch: routed by load only"
        elif self.circuit.is_open(now):
            state = self.down_reason or "ejected"
        else:
            state = self.down_reason or "unhealthy"
        return f"{self.name} ({state})"
