"""The start-up floor: a p99 no router can beat when it sends every request as it arrives.

A closed-loop run opens with `concurrency` requests sent at once on empty caches. Each tenant in
that burst costs at least one full prefill of its prompt (nothing is cached anywhere yet), so
with k tenants over n replicas some replicas take m = ceil(k / n) of them, and each of those
replicas computes at least the m cheapest such prefills before its last first token.

Its requests end only after that: a sim step (like vLLM's) runs every running request's next
decode token beside up to `step_tokens` prompt tokens, so a request that got its first token
still needs `max_tokens - 1` steps, and each of them waits for the prefill chunk it shares a step
with. When those steps outnumber the prefill steps left, every one of the m requests there ends
after the last prefill. If that puts at least as many requests above the floor as the nearest-rank
p99 lets go (3 of 288), the p99 of all requests is at least the floor, whatever the policy.

A gateway could only go below it by holding requests back until a replica is idle, which throws
away batching; bench/results show every policy above it (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Floor:
    seconds: float  # the prefill every request on a busiest replica waits for
    tenants: int  # distinct tenants in the opening burst
    per_replica: int  # cold prefills on each of the busiest replicas (m)
    busiest: int  # replicas that take m of them
    requests: int  # requests that end at or after `seconds`, under any placement
    binds_p99: bool  # `requests` is more than the nearest-rank p99 lets go


def startup_floor(
    opening: Sequence[tuple[str, int]],
    total_requests: int,
    replicas: int,
    s_per_token: float,
    max_tokens: int,
    step_tokens: int,
) -> Floor:
    """`opening`: (tenant, prompt tokens) of the requests sent at once on cold caches."""
    cheapest: dict[str, int] = {}
    for tenant, tokens in opening:
        cheapest[tenant] = min(tokens, cheapest.get(tenant, tokens))
    k = len(cheapest)
    m = math.ceil(k / replicas)
    busiest = k - (m - 1) * replicas
    costs = sorted(cheapest.values())
    seconds = sum(costs[:m]) * s_per_token
    # After the first of the m gets its first token, the others' prefill steps remain; if its
    # decode needs more steps than that, all m end after the last prefill, else only the last.
    left_steps = math.ceil(sum(costs[-(m - 1) :]) / step_tokens) if m > 1 else 0
    per_replica_late = m if max_tokens - 1 >= left_steps else 1
    late = busiest * per_replica_late
    let_go = total_requests - int(0.99 * total_requests)  # nearest rank, as bench/lib/report.py
    return Floor(seconds, k, m, busiest, late, late >= let_go)
