"""Property-based fuzzing of KV-event payloads (hypothesis): no batch loses a replica's index.

Mutated vLLM 0.33 batches (fields replaced by junk of every type, tokens past 32 bits, maps inside
extra_keys, lists as hashes, bad `ts`, unknown events, truncated or random bytes) go through the
subscriber's own ingestion (`gateway.events.ingest.ingest_batch`: decode, hash, apply) between
well-formed batches. Nothing may raise, a well-formed event in a mutated batch must still be
applied, and the replica's prefix stored first must stay matched. The last test sends a few
hundred mutated batches over a real ZMQ PUB to a running subscriber, which must keep its index
and its task.

`KVGATE_FUZZ_EXAMPLES` sets the example count (default 1000; docs/reliability.md has a bigger run).
"""

from __future__ import annotations

import asyncio
import os
import random

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachekey.events import seq_bytes
from cachekey.keys import HashNamespace, block_keys
from gateway.events.event_source import EventSource
from gateway.events.ingest import ingest_batch
from gateway.events.subscriber import KVEventSubscriber
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.names import ReplicaId
from tests.support.metrics import sample
from tests.support.waits import until

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "1000"))
NS = HashNamespace("demo", block_size=4)
R = ReplicaId("http://fuzz")
BASE = list(range(1, 13))  # three blocks stored before every example
# 16 bytes: longer than any junk bytes, so no mutated event can rebind them.
BASE_HASHES = [b"base-block-0001!!", b"base-block-0002!!", b"base-block-0003!!"]
PROBE = list(range(1000, 1008))  # two blocks a well-formed event in the mutated batch stores

JUNK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=6)
    | st.binary(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
FIELDS = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "lookahead_token_ids",
    "type",
]


def stored(hashes, tokens, parent=None, **extra) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "medium": "GPU",
        **extra,
    }


@st.composite
def mutated_event(draw) -> object:
    ev = stored(
        [draw(st.integers(10_000, 2**64 - 1))],  # never one of the fixed chains' hashes
        [draw(st.integers(0, 2**32 - 1)) for _ in range(4)],
        extra_keys=[["lora", ["img", 0]]],
    )
    how = draw(st.sampled_from(["replace", "delete", "positional", "whole", "targeted"]))
    if how == "replace":
        ev[draw(st.sampled_from(FIELDS))] = draw(JUNK)
    elif how == "delete":
        ev.pop(draw(st.sampled_from(FIELDS)), None)
    elif how == "positional":
        return ["BlockStored", *draw(st.lists(JUNK, max_size=10))]
    elif how == "whole":
        return draw(JUNK)
    else:
        ev.update(
            draw(
                st.sampled_from(
                    [
                        {"block_hashes": [[1]]},
                        {"token_ids": [1, 2, 3, 2**32]},
                        {"extra_keys": [[{"a": 1}]]},
                        {"token_ids": [-1, 2, 3, 4]},
                        {"lookahead_token_ids": [[2**40]]},
                        {"block_size": 0},
                        {"parent_block_hash": [1]},
                    ]
                )
            )
        )
    return ev


@st.composite
def mutated_batch(draw) -> bytes:
    good = stored([7001, 7002], PROBE)
    events = draw(st.lists(mutated_event(), max_size=4))
    events.insert(draw(st.integers(0, len(events))), good)
    ts = draw(st.one_of(st.floats(0, 2e9), JUNK))
    rank = draw(st.one_of(st.just(0), JUNK))
    payload = msgspec.msgpack.encode([ts, events, rank])
    cut = draw(st.one_of(st.none(), st.integers(0, len(payload))))
    if cut is not None and draw(st.booleans()):
        return payload[:cut]  # truncated: the whole batch is undecodable
    return payload


def _held(index: BlockIndex, tokens: list[int]) -> int:
    return index.lookup.match(block_keys(tokens, NS), [R])[R]


@pytest.mark.long
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(payload=mutated_batch())
def test_mutated_batches_never_cost_the_replica_its_index(payload):
    index = BlockIndex()
    base = msgspec.msgpack.encode([1.0, [stored(BASE_HASHES, BASE)], 0])
    assert ingest_batch(index, R, NS, None, 0, base)[:3] == ([], 1, 0)
    errors = ingest_batch(index, R, NS, None, 1, payload).errors  # must not raise, whatever it is
    assert _held(index, BASE) == 3
    full = msgspec.msgpack.decode(payload) if _decodes(payload) else None
    if full is not None and isinstance(full[1], list):
        # The well-formed event in the batch was applied, mutated neighbours or not.
        assert _held(index, PROBE) == 2, errors
    # The replica goes on: a later well-formed child of the base chain still lands.
    child = msgspec.msgpack.encode(
        [2.0, [stored([b"base-block-0004!!"], [13, 14, 15, 16], parent=BASE_HASHES[-1])], 0]
    )
    assert ingest_batch(index, R, NS, None, 2, child)[:3] == ([], 1, 0)
    assert _held(index, [*BASE, 13, 14, 15, 16]) == 4


def _decodes(payload: bytes) -> bool:
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return False
    return isinstance(raw, list) and len(raw) >= 2


def _bad(event: object, ts: object = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, [event], 0])


# The inputs found to kill a subscriber or blind its index (issue 13, the fuzz), each with the
# reason it is counted under.
KNOWN_BAD = {
    "bad_block_hashes": _bad(stored([[1]], [1, 2, 3, 4])),
    "bad_token_ids": _bad(stored([9], [1, 2, 3, 2**32])),
    "bad_extra_keys": _bad(stored([9], [1, 2, 3, 4], extra_keys=[[{"a": 1}]])),
    "bad_ts": _bad(stored([9], [1, 2, 3, 4]), ts="yesterday"),
    # A group no engine has: it would hold nothing, so every match on the replica would be 0.
    "bad_group_idx": _bad(stored([9], [1, 2, 3, 4], group_idx=2**60)),
    "not_msgpack": b"\xc1\xc1",
}


def _junk(rng: random.Random, depth: int = 0) -> object:
    """A random msgpack value of any type (what JUNK draws, from a seed)."""
    kind = rng.randrange(8 if depth < 2 else 6)
    if kind == 6:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7:
        return {str(rng.randrange(99)): _junk(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [
        None,
        rng.random() < 0.5,
        rng.randrange(-(2**63), 2**64),
        rng.choice([float("nan"), -1.5, 1e300]),
        rng.choice(["", "x", "GPU", "\u00e9"]),
        rng.randbytes(rng.randrange(7)),
    ][kind]


def _random_batches(rng: random.Random, n: int) -> list[bytes]:
    """n mutated batches from a seed: the hypothesis test above explores the shapes; this one
    only needs many of them on the wire (drawing 200 at once overruns hypothesis's buffer)."""
    out = []
    for _ in range(n):
        events: list[object] = []
        for _ in range(rng.randrange(5)):
            ev = stored([rng.randrange(10_000, 2**64)], [rng.randrange(2**32) for _ in range(4)])
            how = rng.randrange(4)
            if how == 0:
                ev[rng.choice(FIELDS)] = _junk(rng)
            elif how == 1:
                ev.pop(rng.choice(FIELDS), None)
            elif how == 2:
                ev = ["BlockStored", *(_junk(rng) for _ in range(rng.randrange(10)))]
            else:
                ev = _junk(rng)
            events.append(ev)
        events.insert(rng.randrange(len(events) + 1), stored([7001, 7002], PROBE))
        payload = msgspec.msgpack.encode([_junk(rng) if rng.random() < 0.3 else 1.0, events, 0])
        out.append(payload[: rng.randrange(len(payload))] if rng.random() < 0.1 else payload)
    return out


def test_mutated_batches_over_zmq_keep_the_subscriber_and_the_index():
    batches = _random_batches(random.Random(13), 300)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        index, metrics = BlockIndex(), GatewayMetrics()
        source = EventSource("fuzz", "127.0.0.1", port, None, "kv", None)
        async with httpx.AsyncClient() as http:
            sub = KVEventSubscriber(R, source, NS, index, http, ctx, metrics)
            task = asyncio.create_task(sub.run())
            try:
                await asyncio.wait_for(sub.synced.wait(), 5)
                await pub.recv()  # the subscription arrived
                base = msgspec.msgpack.encode([1.0, [stored(BASE_HASHES, BASE)], 0])
                sent = [base, *KNOWN_BAD.values(), *batches]
                for seq, payload in enumerate(sent):
                    await pub.send_multipart([b"kv", seq_bytes(seq), payload])
                await until(lambda: sub.last_seq == len(sent) - 1, timeout=30)
                assert not task.done()
                assert _held(index, BASE) == 3
                assert sample(metrics, "kvgate_event_resyncs_total") == 1  # the start only
                count = metrics.registry.get_sample_value
                for reason in KNOWN_BAD:
                    assert (count("kvgate_event_errors_total", {"reason": reason}) or 0) >= 1
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                pub.close(linger=0)
        ctx.term()

    asyncio.run(main())
