"""Fault injection for tests (`--enable-fault-injection`, `POST /debug/fault`).

Kept out of the production paths: a crash or stall is an ordinary command posted to the engine
thread, and dropped event batches come from a publisher subclass that only a worker started
with the flag uses.
"""

from __future__ import annotations

import logging
import threading

from worker.engine.llm_engine import LLMEngine
from worker.server.engine_client import AsyncEngine
from worker.server.kv_publisher import EventPublisher, KVEventPublisher, PublisherConfig

logger = logging.getLogger(__name__)

FAULT_KINDS = ("crash_engine", "stall_engine", "drop_events")


class InjectedCrash(RuntimeError):
    """Raised on the engine thread to prove the dead-engine path."""


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
    def __init__(self, engine: AsyncEngine, publisher: EventPublisher) -> None:
        self._engine = engine
        self._publisher = publisher
        self._release = threading.Event()

    def inject(self, kind: str, count: int = 1) -> None:
        """Raises ValueError for an unknown kind or a fault this worker cannot produce."""
        if kind == "crash_engine":
            self._engine.post(_crash)
        elif kind == "stall_engine":
            self._engine.post(self._stall)
        elif kind == "drop_events":
            if not isinstance(self._publisher, DroppingKVEventPublisher):
                raise ValueError("drop_events needs KV events enabled")
            if count <= 0:
                raise ValueError(f"drop count must be positive, got {count}")
            self._publisher.drop_next(count)
        else:
            raise ValueError(f"unknown fault kind {kind!r}; use {', '.join(FAULT_KINDS)}")

    def release(self) -> None:
        """End a stall (at shutdown), so the engine thread can stop."""
        self._release.set()

    def _stall(self, _: LLMEngine) -> None:
        self._release.wait()


def _crash(_: LLMEngine) -> None:
    raise InjectedCrash("fault injection: crash_engine")
