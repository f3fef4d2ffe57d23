"""Fault injection for tests (`--enable-fault-injection`, `POST /debug/fault`).

Kept out of the production paths: a crash, a stall or dropped event batches are a `Fault`
message to the engine core process (engine_core.py), which crashes or stalls its loop there, and
drops batches through a publisher subclass that only a worker started with the flag uses. A
`poison` marker makes every later request whose body holds it crash the engine once it is in
it: a request that kills whichever engine serves it (gateway/serving/poison.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pydantic import BaseModel

from worker.server.kv_publisher import KVEventPublisher, PublisherConfig

if TYPE_CHECKING:
    from worker.server.engine_client import AsyncEngine

logger = logging.getLogger(__name__)

FAULT_KINDS = ("crash_engine", "stall_engine", "drop_events", "poison")


class InjectedCrash(RuntimeError):
    """Raised in the engine core's loop to prove the dead-engine path."""


class DroppingKVEventPublisher(KVEventPublisher):
    """A publisher that can withhold batches from PUB; they stay in the replay buffer."""

    def __init__(self, config: PublisherConfig) -> None:
        super().__init__(config)
        self._drop_remaining = 0  # set by the event loop, read by the publisher thread

    def drop_next(self, n: int) -> None:
        self._drop_remaining = n

    def _send_live(self, seq: int, payload: bytes) -> None:
        if self._drop_remaining > 0:
            self._drop_remaining -= 1
            logger.warning("fault injection: kv-events batch %d not sent", seq)
            return
        super()._send_live(seq, payload)


class FaultInjector:
    def __init__(self, engine: AsyncEngine, events_enabled: bool) -> None:
        self._engine = engine
        self._events_enabled = events_enabled
        self._poison: str | None = None

    def inject(self, kind: str, count: int = 1, marker: str | None = None) -> None:
        """Raises ValueError for an unknown kind or a fault this worker cannot produce."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; use {', '.join(FAULT_KINDS)}")
        if kind == "poison":
            if not marker:
                raise ValueError("poison needs a marker (the text that makes a request poison)")
            self._poison = marker
            return
        if kind == "drop_events":
            if not self._events_enabled:
                raise ValueError("drop_events needs KV events enabled")
            if count <= 0:
                raise ValueError(f"drop count must be positive, got {count}")
        self._engine.inject_fault(kind, count)

    def added(self, body: BaseModel) -> None:
        """A request is in the engine: crash it if the request holds the poison marker."""
        if self._poison is not None and self._poison in body.model_dump_json():
            logger.warning("fault injection: a poison request crashes the engine")
            self._engine.inject_fault("crash_engine")
