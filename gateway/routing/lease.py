"""Lease: a routed request's load on the replica that holds its slot.

What routing charges to that replica until the request no longer needs it: its uncached prompt
tokens as queued prefill (until its first token), its decayed recent prefill, its LoRA adapter's
last use, and its speculative entry in the index (a `Guess`, gateway/index/speculative.py).
The routing decision (routing/request.py) takes the lease, moves it when an attempt fails or an
EPP proxy sends the request elsewhere, and ends it once. The admission slot itself is
admission.py's; the lease is everything else the replica's load view holds for the request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from cachekey.types import BlockKey
from gateway.fleet.replica import Replica
from gateway.index.speculative import Guess
from gateway.routing.adapters import note_routed
from gateway.state import GatewayState


@dataclass(slots=True, eq=False)
class Lease:
    state: GatewayState
    replica: Replica | None = None  # holds the request's slot
    predicted: int = 0  # cached tokens expected on `replica`
    uncached: int = 0  # prompt tokens it computes there: charged as queued prefill
    prefilling: bool = False  # `uncached` is still charged to `replica`
    guess: Guess | None = None  # its speculative entry on `replica`

    def take(
        self,
        rep: Replica,
        predicted: int,
        num_prompt_tokens: int,
        keys: Sequence[BlockKey],
        lora_name: str | None,
    ) -> None:
        """Charge `rep` with the request: it holds the request's slot from now on."""
        st = self.state
        self.replica = rep
        self.predicted = predicted
        self.uncached = uncached = num_prompt_tokens - predicted
        rep.in_flight_prefill_tokens += uncached
        self.prefilling = True
        now = time.monotonic()
        rep.add_recent_prefill(uncached, now, st.config.recent_half_life)
        if rep.parity_ok:
            self.guess = st.index.speculate(rep.id, keys)
        if lora_name is not None:
            note_routed(rep, lora_name, now, st.config.speculative_ttl)

    def first_token(self) -> None:
        """Its prefill finished: no queued prefill any more, and its keys are a hit anywhere."""
        self._uncharge()
        if self.guess is not None:
            self.guess.show()

    def forget(self) -> None:
        """Undo the charge: the request never reached the replica (it moves on, or stops)."""
        self._uncharge()
        if self.guess is not None:
            self.guess.discard()
            self.guess = None

    def end(self, refused: bool) -> None:
        """The request ended there; `refused`: the worker refused it, so nothing was cached."""
        self._uncharge()
        if self.guess is not None:
            if refused:
                self.guess.discard()
            else:
                self.guess.release()

    def _uncharge(self) -> None:
        if self.prefilling and self.replica is not None:
            self.prefilling = False
            self.replica.in_flight_prefill_tokens -= self.uncached
