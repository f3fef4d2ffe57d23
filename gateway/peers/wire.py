"""What one gateway tells its peers: one `PeerBatch` per send, msgpack-encoded.

A batch carries the sender's whole in-flight load (absolute counts, so a lost batch costs
nothing once the next arrives) and the placement changes since the last batch, which mirror its
requests' speculative entries (gateway/index/speculative.py): placed, shown (prefill done),
ended (released, or discarded when the worker never got it).
"""

from __future__ import annotations

import msgspec

PLACED, SHOWN, RELEASED, DISCARDED = 0, 1, 2, 3


class Placement(msgspec.Struct, array_like=True, frozen=True):
    op: int  # PLACED, SHOWN, RELEASED or DISCARDED
    id: int  # the placement's number at its sender
    replica: str = ""  # PLACED only
    keys: list[bytes] = []  # PLACED only: the blocks it will hold there
    tokens: int = 0  # PLACED only: the uncached prompt tokens it prefills there


class PeerBatch(msgspec.Struct, array_like=True, frozen=True):
    sender: str  # random per gateway process: a restarted gateway is a new peer
    seq: int
    sent: float  # wall-clock time (peer lag; clocks in step, as for the KV events)
    load: dict[str, int]  # replica id -> the sender's own requests holding a slot there
    placements: list[Placement] = []
    # The sender's requests holding a slot or waiting for one (its share of the cap: shares.py).
    demand: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerBatch)


def encode(batch: PeerBatch) -> bytes:
    return _encoder.encode(batch)


def decode(data: bytes) -> PeerBatch:
    """Raises msgspec.DecodeError (a ValueError) on anything that is not a batch."""
    return _decoder.decode(data)
