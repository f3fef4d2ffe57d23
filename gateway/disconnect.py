"""Noticing a client that leaves before its answer, so its work on the worker is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


async def _disconnected(receive: Receive) -> None:
    # Once the body is read, the only message left on the ASGI channel is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(receive: Receive, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client disconnects first: `work` is then cancelled
    and awaited, so its own cleanup (an upstream connection dropped, a slot given back) has
    run when this returns."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()
