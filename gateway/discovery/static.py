"""Static discovery: the `--workers` list, announced once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from gateway.discovery import OnChange


class StaticDiscovery:
    def __init__(self, urls: Iterable[str]) -> None:
        self.urls = frozenset(u.rstrip("/") for u in urls)

    async def run(self, on_change: OnChange) -> None:
        await on_change(self.urls)
        await asyncio.Event().wait()  # nothing ever changes; run until cancelled
