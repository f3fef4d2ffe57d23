"""A replica's health as the pollers see it, and why it takes no traffic when it does not.

`down_reason` says why, for the gateway's log and its 503s; a down worker is logged at once,
again when the reason's kind changes, and every 30 s while it stays down. A poll that gets no
answer marks a healthy worker down only after --down-after-failed-polls in a row. ReplicaSet
(replica_set.py) polls; this is what it does with the answers' health.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.config import GatewayConfig
from gateway.fleet.replica import Replica
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.upstream.pool import Fetched

log = logging.getLogger("gateway.fleet.replica_set")  # one logger for the replica set's story

_REWARN_SECONDS = 30.0  # how often an unreachable worker is logged again


def _reason(resp: Fetched) -> str:
    """The message of a worker's error body, else the start of its text."""
    try:
        return str(json.loads(resp.body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200] or f"HTTP {resp.status}"


def refusal(info_r: Fetched) -> str:
    if info_r.status == 401:
        return "/kvgate/info answered 401: the worker does not take this gateway's worker token"
    return f"/kvgate/info answered {info_r.status}"


def _cause(reason: str | None) -> str | None:
    """A down reason's kind ("unreachable", "/kvgate/info answered 401", "/health 503"), without
    the details that may change from one poll to the next."""
    return reason.split(":", 1)[0] if reason else reason


class ReplicaHealth:
    """What the replica set (replica_set.py, which holds this) does with its polls' health
    answers: marks replicas up and down, logs why, and tells the set's waiters (`changed`)."""

    def __init__(
        self,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        index: BlockIndex,
        changed: asyncio.Event,
        stop_following: Callable[[Replica], Awaitable[None]],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.index = index
        self.changed = changed  # set when a replica turns healthy or unhealthy
        self._stop_following = stop_following  # its KV events (gateway/events/followers.py)

    def set_health(self, rep: Replica, health_r: Fetched) -> None:
        ejected = rep.circuit.is_open(time.monotonic())
        healthy = health_r.status == 200 and not ejected
        if not healthy and not ejected:
            rep.health.down_reason = f"/health {health_r.status}: {_reason(health_r)}"
        if healthy != rep.healthy:
            if healthy:
                log.info("replica %s healthy", rep.where)
            else:
                log.warning("replica %s unhealthy: %s", rep.where, rep.health.down_reason)
            rep.healthy = healthy
            rep.health.down_reason = None if healthy else rep.health.down_reason
            rep.health.warned_at, rep.health.warned_reason = (
                time.monotonic(),
                rep.health.down_reason,
            )
            self.changed.set()
        elif not healthy:
            self._warn_down(rep)
        self.metrics.replica_healthy.labels(rep.name).set(1 if healthy else 0)

    async def unreachable(self, head: Replica, why: str) -> None:
        """A poll got no answer. A healthy worker is marked down (its index entries dropped)
        only after --down-after-failed-polls in a row: one poll too slow on an overloaded host
        would otherwise drop the index of every worker it fronts, and rebuilding them all at
        once deepens the overload (seen at 512 workers behind 4 gateways, docs/benchmarks.md)."""
        head.health.failed_polls += 1
        limit = self.config.down_after_failed_polls
        if head.healthy and head.health.failed_polls < limit:
            log.warning(
                "worker %s: poll failed (%s), %d of %d before it is marked down",
                head.url,
                why,
                head.health.failed_polls,
                limit,
            )
            return
        await self.mark_down(head, f"unreachable: {why}")

    async def mark_down(self, head: Replica, reason: str) -> None:
        for rep in head.ranks:
            was_up = rep.healthy or rep.instance_id is not None
            rep.health.down_reason = reason
            if was_up:
                log.warning("replica %s %s; dropping its index entries", rep.where, reason)
                rep.health.warned_at, rep.health.warned_reason = time.monotonic(), reason
            else:
                self._warn_down(rep)
            rep.healthy = False
            rep.instance_id = None
            self.metrics.replica_healthy.labels(rep.name).set(0)
            await self._stop_following(rep)
            self.index.drop_replica(rep.id)

    def _warn_down(self, rep: Replica) -> None:
        """Log a replica that is down at once, again as soon as the reason changes (a worker
        that was not up yet now refuses the token: the real cause), and every _REWARN_SECONDS
        while it stays down."""
        now = time.monotonic()
        new = _cause(rep.health.down_reason) != _cause(rep.health.warned_reason)
        if new or rep.health.warned_at is None or now - rep.health.warned_at >= _REWARN_SECONDS:
            rep.health.warned_at, rep.health.warned_reason = now, rep.health.down_reason
            log.warning("worker %s takes no traffic: %s", rep.where, rep.health.down_reason)
