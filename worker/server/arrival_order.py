"""Requests reach the engine in the order they arrived at the worker.

Each request renders in a thread of its own (templating, tokenizing, image decoding), so renders
finish in any order. The gateway predicts a request's cached prefix from the order it sent them:
of two requests sharing a new prefix, the one sent second is the one that hits what the first
computes. A worker that let the second overtake would hit on the first instead, and both
predictions would be wrong. So a request takes a turn when it arrives and waits for the turns
before it only at the last moment, just before it is added to the engine.
"""

from __future__ import annotations

import asyncio


class Turn:
    __slots__ = ("_before", "_mine")

    def __init__(self, before: asyncio.Future[None] | None, mine: asyncio.Future[None]) -> None:
        self._before = before
        self._mine = mine

    async def reached(self) -> None:
        """Wait until every request that arrived earlier has reached the engine or failed."""
        if self._before is not None and not self._before.done():
            # Shielded: a client that leaves while waiting must not cancel an earlier turn.
            await asyncio.shield(self._before)

    def leave(self) -> None:
        """This request is in the engine (or failed): the next one may go. Idempotent."""
        if not self._mine.done():
            self._mine.set_result(None)


class ArrivalOrder:
    """One per engine: turns in arrival order."""

    def __init__(self) -> None:
        self._last: asyncio.Future[None] | None = None

    def take(self) -> Turn:
        """A turn after every turn taken so far; take it before the request's first await."""
        mine = asyncio.get_running_loop().create_future()
        turn = Turn(self._last, mine)
        self._last = mine
        return turn
