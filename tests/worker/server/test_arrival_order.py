"""ArrivalOrder: requests reach the engine in arrival order, whatever order their renders end in."""

from __future__ import annotations

import asyncio

from worker.server.arrival_order import ArrivalOrder, Turn


async def _request(turn: Turn, render_s: float, added: list[str], name: str) -> None:
    try:
        await asyncio.sleep(render_s)  # a render in a thread: later arrivals may finish first
        await turn.reached()
        added.append(name)
    finally:
        turn.leave()


def test_later_renders_wait_for_earlier_arrivals() -> None:
    async def main() -> list[str]:
        order, added = ArrivalOrder(), []
        turns = [order.take() for _ in range(3)]
        await asyncio.gather(
            _request(turns[0], 0.05, added, "a"),
            _request(turns[1], 0.0, added, "b"),
            _request(turns[2], 0.02, added, "c"),
        )
        return added

    assert asyncio.run(main()) == ["a", "b", "c"]


def test_a_failed_or_cancelled_request_lets_the_next_one_go() -> None:
    async def main() -> list[str]:
        order, added = ArrivalOrder(), []
        failing, gone, last = order.take(), order.take(), order.take()

        async def fails() -> None:
            try:
                await asyncio.sleep(0.01)
                raise ValueError("bad image")  # a render error: never reaches the engine
            finally:
                failing.leave()

        waiting = asyncio.create_task(_request(gone, 0.0, added, "gone"))
        task = asyncio.create_task(_request(last, 0.0, added, "last"))
        await asyncio.sleep(0)
        waiting.cancel()  # the client left while waiting for its turn
        results = await asyncio.gather(fails(), waiting, task, return_exceptions=True)
        assert isinstance(results[0], ValueError)
        assert isinstance(results[1], asyncio.CancelledError)
        return added

    assert asyncio.run(asyncio.wait_for(main(), 5)) == ["last"]
