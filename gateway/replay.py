"""ReplayClient: fetches buffered KV-event batches from a worker's replay ROUTER over a DEALER.

One request at a time, from the subscriber's own task. The socket is kept between requests (the
subscriber asks after every idle interval) and rebuilt after a request that got no whole answer,
so that a late reply is never read as the answer to the next request.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from cachekey.events import DecodeError, parse_replay_reply, seq_bytes
from cachekey.worker_auth import CurveKeys

log = logging.getLogger(__name__)


class ReplayClient:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        ipv6: bool,
        timeout: float,
        name: str,
        curve: CurveKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._ctx = ctx
        self._ipv6 = ipv6
        self._timeout = timeout
        self._name = name
        self._curve = curve
        self._dealer: zmq.asyncio.Socket | None = None
        self._failing = False

    async def fetch(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every buffered batch with seq >= start, oldest first; None when no whole answer came."""
        try:
            batches = await self._request(start)
        except (TimeoutError, zmq.ZMQError, DecodeError) as e:
            # Once per failure streak: an idle subscriber asks again every interval.
            level = logging.DEBUG if self._failing else logging.WARNING
            reason = str(e) or type(e).__name__
            log.log(
                level,
                "%s: replay from seq %d at %s failed: %s",
                self._name,
                start,
                self.endpoint,
                reason,
            )
            self._failing = True
            self.close()
            return None
        if self._failing:
            log.info("%s: replay at %s answers again", self._name, self.endpoint)
            self._failing = False
        return batches

    async def _request(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self._socket()
        await dealer.send_multipart([b"", seq_bytes(start)])
        batches: list[tuple[int, bytes]] = []
        while True:
            reply = await asyncio.wait_for(dealer.recv_multipart(), self._timeout)
            item = parse_replay_reply(reply)
            if item is None:
                return batches
            batches.append(item)

    def close(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IPV6, self._ipv6)
            if self._curve is not None:
                self._curve.connect(dealer)
            dealer.connect(self.endpoint)
            self._dealer = dealer
        return self._dealer
