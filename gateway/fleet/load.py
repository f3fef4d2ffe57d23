"""ReplicaLoad: a replica's load as routing reads it, the worker's polled gauges and the
gateway's own accounting.

A base class of `Replica` (replica.py) rather than a field of it: the policies read these
fields for every candidate of every request, and an inherited slot costs nothing more to read,
where `rep.load.in_flight` would add a lookup per candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cachekey.documents import LoRAAdapters
from cachekey.types import BlockKey
from gateway.fleet.latency import LatencyModel
from gateway.fleet.prefill_rate import PrefillRate


@dataclass(slots=True, kw_only=True)
class ReplicaLoad:
    # Worker-reported (polled, replica_set.py `_set_load`).
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    # Requests holding a slot here: the gateway's own (admission.py moves them) and, with
    # peers, the other gateways'.
    in_flight: int = 0
    # How much of `in_flight` is other gateways' requests (gateway/peers/view.py adds them).
    peer_in_flight: int = 0
    # Requests the worker counted (running + waiting) at its last poll beyond `in_flight` then:
    # other gateways' that no peer reported. Kept apart so the count stays fresh between polls.
    foreign: float = 0.0
    # Uncached prompt tokens of this gateway's requests here that have no first token yet.
    in_flight_prefill_tokens: int = 0
    # How many of them (each pays the worker's per-request admission work before its token).
    in_flight_prefills: int = 0
    # Prompt tokens (cached or not) of this gateway's requests here until they end: the KV
    # context they hold and decode over (Dynamo's active blocks; exported as a metric).
    in_flight_tokens: int = 0
    # This gateway's requests here by their prefixes (prefix_load.py: a few keys a request):
    # cache_aware's busy term charges a holder for those sharing the request's prefix.
    in_flight_prefixes: dict[BlockKey, int] = field(default_factory=dict)
    prefill_rate: PrefillRate = field(default_factory=PrefillRate)  # from the worker's metrics
    # Seconds per token copied back from its host tier (copy_rate.py), measured alike.
    copy_rate: PrefillRate = field(default_factory=PrefillRate)
    # Its TTFT against the load it was sent into, fitted from the gateway's own timings.
    latency: LatencyModel = field(default_factory=LatencyModel)
    # Its requests' whole time (to the end of the answer) against the same load.
    duration: LatencyModel = field(default_factory=LatencyModel)
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

    def count_foreign(self) -> None:
        """The worker's gauges were just polled: what it runs beyond this gateway's requests."""
        self.foreign = max(self.running + self.waiting - self.in_flight, 0.0)

    def requests_there(self) -> float:
        """Requests on the replica now: this gateway's (and its peers') in flight, exact, plus
        the others the worker counted at its last poll. Not the larger of the gateway's count
        and the worker's: a poll is up to an interval old, and with one gateway it read above
        the exact count for 26% of the candidates cache_aware priced (by 1.8 requests on
        average: requests that had ended since), charging the replicas that had just freed
        (docs/benchmarks.md, *Routing in the calibrated sim*, step 6)."""
        return self.in_flight + self.foreign

    def recent_prefill_at(self, now: float, half_life: float) -> float:
        return self.recent_prefill * 0.5 ** ((now - self.recent_at) / half_life)

    def add_recent_prefill(self, tokens: int, now: float, half_life: float) -> None:
        self.recent_prefill = self.recent_prefill_at(now, half_life) + tokens
        self.recent_at = now
        if self.recent_prefill > 0:
            self.recent_key = math.log2(self.recent_prefill) + now / half_life
