"""Replica: one data-parallel rank of one worker, as routing sees it (gateway/fleet/replica_set.py
keeps the set of them in step with the workers).

Its parts: its identity (the fields here), its load (`ReplicaLoad`, load.py, a base class so the
policies read it at no extra cost), why it is down (`HealthState`, health_state.py), its circuit
breaker's state (`Circuit`, breaker.py) and its link (`ReplicaLink`, link.py: the connection
pool, event subscriber and tasks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachekey.documents import WorkerInfo
from cachekey.keys import HashNamespace, MMMatchRule
from gateway.discovery.endpoints import WorkerEndpoint
from gateway.fleet.breaker import Circuit
from gateway.fleet.health_state import HealthState
from gateway.fleet.link import ReplicaLink
from gateway.fleet.load import ReplicaLoad
from gateway.fleet.ranks import RankSlot
from gateway.names import ReplicaId, replica_name


@dataclass(slots=True)
class Replica(ReplicaLoad):
    id: ReplicaId
    url: str
    name: str = ""  # what clients see (x-kvgate-replica): never the URL (gateway/names.py)
    dp_rank: int | None = None  # its global data-parallel rank (None: not data parallel)
    rank_header: int | None = None  # the X-data-parallel-rank a request sends (None: none)
    endpoint: WorkerEndpoint | None = None  # what discovery says about its URL
    instance_id: str | None = None
    model: str | None = None
    fingerprint: str | None = None
    namespace: HashNamespace | None = None
    info: WorkerInfo | None = None
    # Routing reads these two for every candidate, so they stay flat here.
    healthy: bool = False
    parity_ok: bool = True
    health: HealthState = field(default_factory=HealthState)  # why it is down (when it is)
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

    @property
    def where(self) -> str:
        """`name (url)`, for operators' logs: the name, and the URL to join it with."""
        return f"{self.name} ({self.id})"

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.circuit.open_until

    def describe(self, now: float) -> str:
        """`name (why it takes no traffic)`, or `name (healthy...)`: for clients, so no URL."""
        if self.available(now):
            state = "healthy" if self.parity_ok else "healthy, parity mismatch: routed by load only"
        elif self.circuit.is_open(now):
            state = self.health.down_reason or "ejected"
        else:
            state = self.health.down_reason or "unhealthy"
        return f"{self.name} ({state})"
