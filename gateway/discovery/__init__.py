"""Worker discovery: a source of the full current set of worker base URLs.

`static.StaticDiscovery` serves `--workers`; `k8s.KubernetesDiscovery` watches EndpointSlices.
Both implement `Discovery`: `run(on_change)` calls `on_change(urls)` with the whole set every
time it changes (at least once), and runs until cancelled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

OnChange = Callable[[frozenset[str]], Awaitable[None]]


class Discovery(Protocol):
    async def run(self, on_change: OnChange) -> None: ...


__all__ = ["Discovery", "OnChange"]
