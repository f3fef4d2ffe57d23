"""Static discovery: the `--workers` list, announced once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from gateway.discovery import OnChange
from gateway.discovery.endpoints import parse_worker


class StaticDiscovery:
    def __init__(self, specs: Iterable[str]) -> None:
        self.workers = frozenset(parse_worker(s) for s in specs)

    async def run(self, on_change: OnChange) -> None:
        await on_change(self.workers)
        await asyncio.Event().wait()  # nothing ever changes; run until cancelled
