"""Lease: a routed request's hold on a replica, its slot and the load charged there.

What routing charges to that replica until the request no longer needs it: its admission slot,
its uncached prompt tokens as queued prefill (until its first token), its decayed recent
prefill, its LoRA adapter's last use, and its speculative entry in the index (a `Guess`,
gateway/index/speculative.py). The routing decision (routing/request.py) picks the replica and
takes the lease there; the retry path (serving/retry.py) and the EPP (epp/served.py) move it to
another replica or drop it; the request's release ends it, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachekey.types import BlockKey
from gateway.config import GatewayConfig
from gateway.fleet.latency import Sample
from gateway.fleet.prefix_load import hold, marks, unhold
from gateway.fleet.replica import Replica
from gateway.index.block_index import BlockIndex
from gateway.index.speculative import Guess
from gateway.metrics import GatewayMetrics
from gateway.peers.outbox import PeerOutbox
from gateway.routing.adapters import note_routed
from gateway.routing.admission import Admission

# The cached tokens a replica is expected to hit: in all, and of those its host tier's.
Prediction = tuple[int, int]


@dataclass(slots=True, eq=False)
class Lease:
    admission: Admission
    index: BlockIndex
    config: GatewayConfig  # the half-life of recent prefill, the speculative TTL
    metrics: GatewayMetrics  # the error of the time to first token its replica predicted
    replica: Replica | None = None  # holds the request's slot (None: none yet, or given back)
    predicted: int = 0  # cached tokens expected on `replica` (both tiers)
    predicted_host: int = 0  # of those, the ones its host tier serves
    uncached: int = 0  # prompt tokens it computes there: charged as queued prefill
    prefilling: bool = False  # `uncached` is still charged to `replica`
    guess: Guess | None = None  # its speculative entry on `replica`
    sample: Sample | None = None  # the load `replica` had when it was sent there (latency.py)
    held: int = 0  # prompt tokens charged to `replica`'s in_flight_tokens until the request ends
    marks: tuple[BlockKey, ...] = ()  # its prefix marks counted there meanwhile (prefix_load)
    # What the request is, wherever the lease moves (set by `take`):
    prompt_tokens: int = 0
    keys: Sequence[BlockKey] = ()  # the keys the replica holds once it has prefilled it
    lora_name: str | None = None
    # The other gateways hear of its speculative entry through this (None: no peers).
    peers: PeerOutbox | None = None
    placement: int = 0  # its speculative entry's id at the peers (0: none)

    def take(
        self,
        rep: Replica,
        predicted: Prediction,
        prompt_tokens: int,
        keys: Sequence[BlockKey],
        lora_name: str | None,
    ) -> None:
        """`rep` holds the request's slot (admission placed it there): charge it the request."""
        self.prompt_tokens, self.keys, self.lora_name = prompt_tokens, keys, lora_name
        self.marks = marks(keys)
        self._charge(rep, predicted)

    def move(
        self, ranked: list[Replica], predict: Callable[[Replica], Prediction]
    ) -> Replica | None:
        """After a failed attempt: the slot and the load move to the first of `ranked` with
        room, which `predict` tells the expected hit of (None: no room, or `ranked` empty,
        and the slot is given back)."""
        rep = self._leave()
        nxt = self.admission.move(rep, ranked)
        if nxt is not None:
            self._charge(nxt, predict(nxt))
        return nxt

    def transfer(self, target: Replica, predicted: Prediction) -> None:
        """EPP mode: the proxy sent the request to `target`, not to the replica holding the
        slot. The slot and the load move there even over its cap: it is running there."""
        rep = self._leave()
        self.admission.transfer(rep, target)
        self._charge(target, predicted)

    def drop(self) -> None:
        """Nothing reached a worker (EPP mode: the proxy answered the client itself): the slot
        is given back and nothing stays charged or predicted anywhere."""
        self.admission.release(self._leave())

    def first_token(self) -> None:
        """Its prefill finished: no queued prefill any more, and its keys are a hit anywhere;
        its replica's latency model learns its time to first token."""
        if self.prefilling and self.sample is not None and self.replica is not None:
            error = self.replica.latency.finish(self.sample)
            if error is not None:
                self.metrics.ttft_prediction_error.observe(error)
        self._uncharge()
        shown = self.guess is not None and self.guess.shown
        if self.guess is not None:
            self.guess.show()
        if self.placement and not shown:
            # A guess shown at its placement (a worker that defers) is shown at the peers'
            # too (same worker, same rule): telling them again would cost a batch for nothing.
            self.peers.shown(self.placement)

    def end(self, refused: bool) -> None:
        """The request ended on `replica`; `refused`: the worker refused it, so nothing was
        cached. The slot is given back."""
        rep = self.replica
        assert rep is not None
        if not refused and self.sample is not None and not self.prefilling:
            rep.duration.learn(self.sample)  # a stream that got its first token, now whole
        self._uncharge()
        self._unhold(rep)
        if self.guess is not None:
            if refused:
                self.guess.discard()
            else:
                self.guess.release()
        self._tell_ended(refused)
        self.admission.release(rep)

    def _charge(self, rep: Replica, predicted: Prediction) -> None:
        self.replica = rep
        predicted, self.predicted_host = predicted
        self.predicted = predicted
        self.uncached = uncached = self.prompt_tokens - predicted
        # `admission` counted it in `in_flight` already: the load it meets is the others'.
        there = rep.requests_there() - 1
        queued = (rep.in_flight_prefill_tokens, rep.in_flight_prefills)
        self.sample = rep.latency.start(uncached, *queued, there)
        rep.in_flight_prefill_tokens += uncached
        rep.in_flight_prefills += 1
        self.held = self.prompt_tokens
        rep.in_flight_tokens += self.held
        hold(rep.in_flight_prefixes, self.marks)
        self.prefilling = True
        now = time.monotonic()
        rep.add_recent_prefill(uncached, now, self.config.recent_half_life)
        if rep.parity_ok:
            self.guess = self.index.speculate(rep.id, self.keys)
            if self.peers is not None:
                self.placement = self.peers.placed(rep.id, self.keys, uncached)
        if self.lora_name is not None:
            note_routed(rep, self.lora_name, now, self.config.speculative_ttl)

    def _leave(self) -> Replica:
        """Undo the charge on the replica holding the slot (the request never reached it) and
        return that replica, whose slot the caller moves or gives back."""
        rep = self.replica
        assert rep is not None
        self._uncharge()
        self._unhold(rep)
        if self.guess is not None:
            self.guess.discard()
            self.guess = None
        self._tell_ended(refused=True)
        self.replica, self.predicted, self.predicted_host = None, 0, 0
        return rep

    def _tell_ended(self, refused: bool) -> None:
        if self.placement:
            self.peers.ended(self.placement, refused)
            self.placement = 0

    def _uncharge(self) -> None:
        if self.prefilling and self.replica is not None:
            self.prefilling = False
            self.replica.in_flight_prefill_tokens -= self.uncached
            self.replica.in_flight_prefills -= 1

    def _unhold(self, rep: Replica) -> None:
        if self.held:
            unhold(rep.in_flight_prefixes, self.marks)
        rep.in_flight_tokens -= self.held
        self.held = 0
