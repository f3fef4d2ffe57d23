"""PeerShares: each gateway's share of `--max-inflight-per-replica`, so the cap holds across peers.

Counting the peers' in-flight load (view.py) is not enough on its own: a replica's last free slot
is seen free at every gateway until the batch of the one that took it arrives, and when a slot
frees, every gateway's waiters wake and take it at once. So each gateway also keeps within its
share of every replica's cap, and the shares of all gateways add up to the cap.

The cap is split in proportion to each gateway's demand (its requests holding a slot or waiting
for one, plus one: an idle gateway keeps a little), as each gateway last published it, its own
included, so every gateway computes the same split from the same batches. Shares are whole
slots: each gets the floor of its part; the slots left over go, one each, to the largest
remainders, and gateways tied for the last of them take turns replica by replica (a hash of the
replica id, in sender-id order), so a small cap spreads its spare slots over the gateways. Once
every gateway has every other's latest batch the shares add up to the cap exactly; while a batch
is in flight they can differ by a slot, so a share that grows is used only `HOLD` seconds later
(the least of the splits in force lately), while one that shrinks applies at once. A gateway
publishes its demand when it moved by more than a quarter (a steady load does not move the split
on every request), and one whose requests must wait sends a batch at once (`nudge`).

With no peer heard from (none up: dead, partitioned, not started), the share is the whole cap:
a gateway alone routes as it would without peers, and a peer's silence never blocks a request.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gateway.peers.view import PeerView

# Seconds a share that grew waits before it is used: the peers whose shares shrank by as much
# apply theirs when the batch that moved the split reaches them (sub-millisecond to a few ms; a
# margin for a loaded host). A share that shrinks applies at once. So two gateways never both
# count on one slot unless a batch takes longer than this to arrive.
HOLD = 0.1
MAX_RECENT = 64  # splits held back at most (under churn the oldest go first)


@dataclass(slots=True, frozen=True)
class Split:
    """This gateway's share of one cap: the same for every replica but for one spare slot,
    which a gateway tied with others for it gets on some replicas and not on others."""

    base: int  # the floor of its part, plus a spare slot it wins outright
    tied: int  # gateways tied for the last spare slots (0: no tie it is part of)
    position: int  # its place among them (by sender id)
    spare: int  # the spare slots they share

    def limit(self, replica_id: str) -> int:
        """The slots of `replica_id` this gateway may hold itself."""
        if not self.tied:
            return self.base
        turn = zlib.crc32(replica_id.encode()) % self.tied
        return self.base + ((self.position - turn) % self.tied < self.spare)


@dataclass(slots=True, frozen=True)
class Shares:
    """The least of the splits in force lately: a share that grew waits, one that shrank not."""

    splits: tuple[Split, ...]

    def limit(self, replica_id: str) -> int:
        return min(s.limit(replica_id) for s in self.splits)


class PeerShares:
    def __init__(
        self,
        view: PeerView,
        sender: str,
        cap: int,
        nudge: Callable[[], None],
        wake: Callable[[], None],
    ) -> None:
        self.view, self.sender, self.cap = view, sender, cap
        self.nudge = nudge  # send a batch now: this gateway's demand grew
        self._wake = wake  # admission's waiters look again: a held-back share grew
        self._last: Split | None = None
        self._recent: deque[tuple[float, Split]] = deque(maxlen=MAX_RECENT)  # replaced, when
        self._timer: asyncio.TimerHandle | None = None

    def split(self) -> Shares | None:
        """This gateway's share now; None: no peer up (the whole cap)."""
        current = self._compute()
        if current is None:
            self._last = None
            self._recent.clear()
            return None
        now = time.monotonic()
        if current != self._last:
            if self._last is not None:
                self._recent.append((now, self._last))
                self._schedule(HOLD)
            self._last = current
        recent = self._recent
        while recent and now - recent[0][0] > HOLD:
            recent.popleft()
        return Shares((current, *(s for _, s in recent)))

    def _schedule(self, delay: float) -> None:
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(delay, 0.0), self._held_back)

    def _held_back(self) -> None:
        self._timer = None
        self._wake()
        if self._recent:  # later changes still hold a share back
            self._schedule(self._recent[-1][0] + HOLD - time.monotonic())

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _compute(self) -> Split | None:
        view = self.view
        peers = view.peers
        if not peers:
            return None
        weights = [(view.sent_demand + 1, self.sender)]
        weights += [(p.demand + 1, p.sender) for p in peers.values()]
        total = sum(w for w, _ in weights)
        # Whole numbers: cap * w = floor * total + rest; the spare slots go by the largest rest.
        floors = [self.cap * w // total for w, _ in weights]
        rests = sorted(((self.cap * w) % total for w, _ in weights), reverse=True)
        spare = self.cap - sum(floors)
        mine = (self.cap * weights[0][0]) % total
        if spare == 0 or mine < rests[spare - 1]:
            return Split(floors[0], 0, 0, 0)
        edge = rests[spare - 1]  # the rest of the last gateway that gets a spare slot
        if mine > edge:
            return Split(floors[0] + 1, 0, 0, 0)
        above = sum(r > edge for r in rests)
        tied = sorted(s for w, s in weights if (self.cap * w) % total == edge)
        return Split(floors[0], len(tied), tied.index(self.sender), spare - above)


def room(split: Shares | None, cap: int, in_flight: int, own: int, replica_id: str) -> int:
    """Free slots on a replica for this gateway: below the cap, and within its share."""
    free = cap - in_flight
    if split is None:
        return free
    return min(free, split.limit(replica_id) - own)
