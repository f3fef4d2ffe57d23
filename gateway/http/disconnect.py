"""Noticing a client that leaves before its answer, so its work on the worker is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


async def unless_gone(receive: Receive, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client disconnects first.

    `work` runs in the caller's task; one watcher task waits for the disconnect and cancels the
    caller's task while it is inside `work`, so `work`'s own cleanup (an upstream connection
    dropped, a slot given back) has run when this returns None. The watcher is cancelled, with
    no await in between, as soon as `work` is over: it can never cancel anything after it.
    """
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        # Once the body is read, the only message left on the ASGI channel is the disconnect.
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        result = await work
        if gone:  # `work` swallowed the cancellation: it is spent, and so is its count
            task.uncancel()
        return result
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from elsewhere (shutdown): not ours to swallow
        task.uncancel()
        return None
    finally:
        watcher.cancel()
