"""Where one worker instance's KV events come from: its endpoints (`EventSource`) and its
snapshot, which a subscriber (subscriber.py) loads when it (re)syncs."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx

from cachekey.documents import Snapshot, decode_document
from cachekey.worker_auth import CurveKeys

log = logging.getLogger("gateway.events.subscriber")  # the subscriber's story, in one logger


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one worker instance publishes: its events endpoints and snapshot URL."""

    instance_id: str
    host: str
    port: int | None  # None: connect mode, batches come from the central SUB
    replay_port: int | None
    topic: str
    snapshot_url: str | None
    rank: int | None = None  # the data-parallel rank its batches must name (None: any)
    curve: CurveKeys | None = None  # the worker's sockets are CURVE servers (worker token)

    def endpoint(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{port}"

    @property
    def ipv6(self) -> bool:
        return ":" in self.host


async def fetch_snapshot(
    source: EventSource, http: httpx.AsyncClient, name: str
) -> Snapshot | None:
    """The worker's snapshot; None when it has none. A malformed one raises DocumentError,
    which restarts the subscriber (logged with the field at fault)."""
    if source.snapshot_url is None:
        return None
    try:
        resp = await http.get(source.snapshot_url, timeout=30.0)
    except httpx.HTTPError as e:
        log.warning("%s: snapshot failed: %s", name, e)
        return None
    if resp.status_code != 200:
        return None
    return decode_document(resp.content, Snapshot)
