"""How the gateway reaches one replica: its connection pool, its KV-event subscriber, and the
tasks that run its polls and its subscriber (gateway/fleet/replica_set.py starts and stops them)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.events.subscriber import KVEventSubscriber
from gateway.upstream.pool import UpstreamPool


@dataclass(slots=True)
class ReplicaLink:
    # Keep-alive connections for requests and polls (one pool per worker URL, shared by its
    # ranks); the snapshot and asset fetches go through httpx.
    pool: UpstreamPool | None = None
    subscriber: KVEventSubscriber | None = None
    poll_task: asyncio.Task | None = None  # on the head replica of a URL
    sub_task: asyncio.Task | None = None
