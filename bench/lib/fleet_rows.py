"""One row of `bench.fleet_scale`: what a (fleet size, gateways, rate, policy) point measured."""

from __future__ import annotations

import os
from dataclasses import dataclass

from bench.lib.fleet_probe import Reading
from bench.lib.report import col, columns, percentile
from harness.open_loop import Outcome
from harness.prom import delta, quantile

# A point keeps up when nothing failed, the trace was served at >= this share of the rate
# offered, and the gateways indexed events within LAG_LIMIT_S (p99).
KEEP_UP_SHARE = 0.95
LAG_LIMIT_S = 1.0


@dataclass(slots=True)
class PointRow:
    replicas: int = col("N", 4)
    label: str = col("gw", 10, left=True, sep=" ")  # gateways, and the baseline's name
    policy: str = col("policy", 12, left=True)
    rate: float = col("rate", 6, ".0f")
    achieved: float = col("done/s", 7, ".1f")
    requests: int = col("reqs", 6)
    failed: int = col("fail", 5)
    hit_rate: float = col("hit", 7, ".1%")
    over_rr: float | None = col("/rr", 6, ".1f")
    of_bound: float | None = col("of bound", 9, ".2f")
    exact: float | None = col("exact", 7, ".1%")
    spills: int = col("spills", 7)  # placed on a shorter prefix than another candidate held
    resyncs: int = col("resync", 7)  # a replica's index entries dropped and reloaded
    latency_p50_ms: float = col("p50 ms", 8, ".0f")
    latency_p99_ms: float = col("p99 ms", 8, ".0f")
    cpu_ms_per_request: float = col("cpu/req", 8, ".2f")  # every gateway's CPU, ms
    ingest_ms_per_k_events: float | None = col("ing/1k", 7, ".1f")
    busy: float = col("busy", 6, ".0%")  # per gateway, share of a core during the run
    idle: float = col("idle", 6, ".1%")  # per gateway, share of a core with no traffic
    lag_p99_ms: float | None = col("lag p99", 8, ".0f")
    peer_lag_p99_ms: float | None = col("peer lag", 9, ".0f")  # a peer batch, sent to applied
    decision_p50_ms: float | None = col("dec p50", 8, ".2f")
    decision_p99_ms: float | None = col("dec p99", 8, ".2f")
    rss_mb: float = col("rss MB", 7, ".0f")
    indexes_equal: bool = col("equal", 6)
    keeps_up: bool = col("kept up", 8)
    load: float = col("load", 6, ".1f")  # the host's 1-minute load average at the end
    fleet_cpu_ms_per_request: float = 0.0
    events: int = 0
    settle_s: float = 0.0  # seconds until the indexes were equal after the trace
    blocks_per_replica: int = 0
    bound_hit_rate: float | None = None

    def finish(self, idle: float, rr_hit: float, bound: float | None, blocks: int) -> None:
        """What needs the other points of its fleet: idle CPU, round robin, the bound."""
        self.idle = idle
        self.over_rr = self.hit_rate / rr_hit if rr_hit else None
        self.bound_hit_rate = bound
        self.of_bound = self.hit_rate / bound if bound else None
        self.blocks_per_replica = blocks


COLUMNS = columns(PointRow)


@dataclass(slots=True)
class IdleRow:
    """The gateways of a set-up before any request: how long until every replica was healthy
    and synced on every gateway (None: not within --ready-timeout), and their CPU then."""

    replicas: int = col("N", 4)
    label: str = col("gateways", 22, left=True, sep=" ")
    ready_s: float | None = col("ready s", 8, ".1f")
    idle: float | None = col("idle cpu", 9, ".1%")  # per gateway, share of a core
    rss_mb: float = col("rss MB", 7, ".0f")


IDLE_COLUMNS = columns(IdleRow)


def make_row(
    label: str,
    replicas: int,
    policy: str,
    rate: float,
    outcomes: list[Outcome],
    before: Reading,
    after: Reading,
    equal: bool,
    settle: float,
) -> PointRow:
    ok = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in ok)
    predicted = [o for o in ok if o.predicted is not None]
    span = max((o.done for o in outcomes), default=0.0) - min((o.sent for o in outcomes), default=0)
    m = delta(after.metrics, before.metrics)
    events = m.total("kvgate_events_applied_total")
    ingest = sum(after.ingest_cpu) - sum(before.ingest_cpu)
    wall = after.at - before.at
    lag = quantile(m, "kvgate_event_lag_seconds", 0.99)
    achieved = len(ok) / span if span > 0 else 0.0
    last_due = max((o.due for o in outcomes), default=0.0)
    offered = (len(outcomes) - 1) / last_due if last_due > 0 else rate  # this draw's own rate
    failed = len(outcomes) - len(ok)
    return PointRow(
        replicas=replicas,
        label=label,
        policy=policy,
        rate=rate,
        achieved=achieved,
        requests=len(outcomes),
        failed=failed,
        hit_rate=sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        over_rr=None,
        of_bound=None,
        exact=sum(o.predicted == o.cached_tokens for o in predicted) / len(predicted)
        if predicted
        else None,
        spills=round(m.total("kvgate_route_spills_total")),
        resyncs=round(m.total("kvgate_event_resyncs_total")),
        latency_p50_ms=percentile([(o.done - o.sent) * 1e3 for o in ok], 0.5),
        latency_p99_ms=percentile([(o.done - o.sent) * 1e3 for o in ok], 0.99),
        cpu_ms_per_request=after.cpu_since(before) * 1e3 / max(len(ok), 1),
        ingest_ms_per_k_events=ingest * 1e6 / events if events else None,
        busy=after.cpu_since(before) / wall / len(after.gateway_cpu),
        idle=0.0,
        lag_p99_ms=lag * 1e3 if lag is not None else None,
        peer_lag_p99_ms=_ms(quantile(m, "kvgate_peer_lag_seconds", 0.99)),
        decision_p50_ms=_ms(quantile(m, "kvgate_routing_decision_seconds", 0.5)),
        decision_p99_ms=_ms(quantile(m, "kvgate_routing_decision_seconds", 0.99)),
        rss_mb=max(after.rss) / 2**20,
        indexes_equal=equal,
        keeps_up=failed == 0
        and achieved >= KEEP_UP_SHARE * offered
        and (lag is None or lag < LAG_LIMIT_S),
        fleet_cpu_ms_per_request=(after.fleet_cpu - before.fleet_cpu) * 1e3 / max(len(ok), 1),
        events=round(events),
        load=os.getloadavg()[0],
        settle_s=round(settle, 1),
    )


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None
