"""Replica discovery: where the workers are. The gateway consumes any `Discovery`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol


class Discovery(Protocol):
    async def run(self, on_change: Callable[[frozenset[str]], Awaitable[None]]) -> None:
        """Emit the full set of worker base URLs whenever it changes; run until cancelled."""
        ...
