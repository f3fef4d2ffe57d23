"""PeerView: what this gateway has heard from its peers, applied to its own index and replicas.

- Load: a peer's in-flight count on a replica is added to that `Replica.in_flight`, the one
  counter admission and the policies read, so `--max-inflight-per-replica` holds across the
  gateways. Each replica's `peer_in_flight` says how much of its count is the peers'.
- Placements: a peer's routed request becomes a speculative entry here (`BlockIndex.speculate`,
  shown, released or discarded as the peer's own is), so the same rules apply: the TTL, and
  confirmation or expiry by the workers' events. Its uncached prefill counts in the replica's
  recent prefill here as at the peer, so the gateways' costs, and with them their choices for a
  new prefix (ties in rendezvous order, routing/policies/base.py), agree.

A peer not heard from for `timeout` seconds (dead, lagging, partitioned) is dropped: its load
is taken back and its entries released to their TTL. This gateway then routes as if it had no
peers; a peer that comes back (a restarted one is a new sender) is a new peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gateway.fleet.replica import Replica
from gateway.index.block_index import BlockIndex
from gateway.index.speculative import Guess
from gateway.peers.wire import PLACED, RELEASED, SHOWN, PeerBatch, Placement


@dataclass(slots=True)
class Peer:
    sender: str
    seen: float  # monotonic time of its last batch
    seq: int = 0
    demand: int = 0  # its requests holding or awaiting a slot (gateway/peers/shares.py)
    load: dict[str, int] = field(default_factory=dict)
    guesses: dict[int, Guess] = field(default_factory=dict)


class PeerView:
    def __init__(
        self,
        index: BlockIndex,
        replicas: Callable[[], Mapping[str, Replica]],  # id -> replica: the replica set's own
        timeout: float,
        freed: Callable[[], None],
        half_life: float,
    ) -> None:
        self.index = index
        self.half_life = half_life  # of recent prefill (--recent-half-life)
        self._replicas = replicas
        self.timeout = timeout
        self._freed = freed  # wakes admission's waiters when peers' load goes down
        self.peers: dict[str, Peer] = {}
        self.own_demand: Callable[[], int] = lambda: 0  # what this gateway tells its peers
        self.sent_demand = 0  # ... as its last batch said (its share: shares.py)
        self.received = 0
        self.applied = 0
        self.gaps = 0

    def apply(self, batch: PeerBatch, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        peer = self.peers.get(batch.sender)
        if peer is None:
            peer = self.peers[batch.sender] = Peer(batch.sender, now)
        elif batch.seq <= peer.seq:
            return  # an old batch (the SUB never reorders; a duplicate endpoint might)
        elif batch.seq != peer.seq + 1:
            # A lost batch may have held an entry's end: none of the peer's entries is left
            # in flight forever; they go to their TTL (the events confirm the real ones).
            self.gaps += 1
            self._release_all(peer)
        peer.seen, peer.seq = now, batch.seq
        if batch.demand != peer.demand:
            peer.demand = batch.demand
            self._freed()  # the shares moved: waiters look again
        by_id = self._replicas()
        self._set_load(peer, batch.load, by_id)
        for p in batch.placements:
            self.received += 1
            self.applied += self._place(peer, p, by_id)

    def _place(self, peer: Peer, p: Placement, by_id: Mapping[str, Replica]) -> bool:
        if p.op == PLACED:
            rep = by_id.get(p.replica)
            if rep is None or not rep.parity_ok:
                return False  # a replica this gateway does not route to (yet)
            peer.guesses[p.id] = self.index.speculate(rep.id, p.keys)
            rep.add_recent_prefill(p.tokens, time.monotonic(), self.half_life)
            return True
        guess = peer.guesses.get(p.id) if p.op == SHOWN else peer.guesses.pop(p.id, None)
        if guess is None:
            return False
        if p.op == SHOWN:
            guess.show()
        elif p.op == RELEASED:
            guess.release()
        else:
            guess.discard()
        return True

    def _set_load(self, peer: Peer, load: dict[str, int], by_id: Mapping[str, Replica]) -> None:
        freed = False
        for rid in peer.load.keys() | load.keys():
            delta = load.get(rid, 0) - peer.load.get(rid, 0)
            rep = by_id.get(rid)
            if rep is not None:  # a replica replaced meanwhile never goes below its own count
                delta = max(delta, -rep.peer_in_flight)
            if delta and rep is not None:
                rep.in_flight += delta
                rep.peer_in_flight += delta
                freed |= delta < 0
        peer.load = {rid: n for rid, n in load.items() if n and rid in by_id}
        if freed:
            self._freed()

    def expire(self, now: float | None = None) -> int:
        """Drop the peers not heard from within `timeout`; how many are up."""
        now = time.monotonic() if now is None else now
        for sender in [s for s, p in self.peers.items() if now - p.seen > self.timeout]:
            self.drop(sender)
        return len(self.peers)

    def drop(self, sender: str) -> None:
        peer = self.peers.pop(sender, None)
        if peer is None:
            return
        self._set_load(peer, {}, self._replicas())
        self._release_all(peer)
        self._freed()  # its share of the cap is the others' now

    @staticmethod
    def _release_all(peer: Peer) -> None:
        for guess in peer.guesses.values():
            guess.release()  # its TTL, then the workers' events say the rest
        peer.guesses.clear()

    def publish_demand(self) -> int:
        """This gateway's demand for the batch being sent: the last one published unless it
        moved by more than a quarter, or to or from zero (a steady load keeps the split still)."""
        demand, sent = self.own_demand(), self.sent_demand
        if demand != sent and (not demand or not sent or 4 * abs(demand - sent) > sent):
            self.sent_demand = demand
            self._freed()  # the shares moved
        return self.sent_demand

    def own_load(self) -> dict[str, int]:
        """This gateway's own requests per replica (what it tells its peers)."""
        return {r.id: n for r in self._replicas().values() if (n := r.in_flight - r.peer_in_flight)}
