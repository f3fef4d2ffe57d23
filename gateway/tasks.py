"""Stopping a background task so that shutdown always ends.

Python 3.11's `asyncio.wait_for` loses a cancellation that arrives as the awaited thing
completes: it returns the result, and the task that was cancelled goes on (CPython gh-86296,
fixed in 3.12). A loop built on it (an event subscriber, a replay request) then never ends,
and whoever awaits it after one `cancel()` hangs: that was the EPP ignoring SIGTERM. The loops
use `asyncio.timeout` instead, which keeps the cancellation; and `cancel_and_wait` cancels
again until the task is done, so one lost cancellation can never hang a shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger(__name__)

_RECANCEL_S = 0.5


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` and wait until it is done, cancelling it again each 0.5 s it goes on."""
    if task is None or task is asyncio.current_task():
        return
    while not task.done():
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=_RECANCEL_S)
        if not done:
            log.warning("task %s ignored a cancellation; cancelling it again", task.get_name())
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
