"""Property-based fuzzing of KV-event payloads (hypothesis): no batch loses a replica's index.

Mutated vLLM 0.33 batches (fields replaced by junk of every type, tokens past 32 bits, maps inside
extra_keys, lists as hashes, bad `ts`, unknown events, truncated or random bytes) go through the
subscriber's own ingestion (`KVEventSubscriber._ingest`: decode, hash, apply) between well-formed
batches. Nothing may raise, a well-formed event in a mutated batch must still be applied, and the
replica's prefix stored first must stay matched. The last test sends a few hundred mutated
batches over a real ZMQ PUB to a running subscriber, which must keep its index and its task.

`KVGATE_FUZZ_EXAMPLES` sets the example count (default 1000; docs/reliability.md has a bigger run).
"""

from __future__ import annotations

import asyncio
import os

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gateway_subscriber import _count, _until

from cachekey.events import seq_bytes
from cachekey.keys import HashNamespace, block_keys
from gateway.index import BlockIndex, ReplicaId
from gateway.metrics import GatewayMetrics
from gateway.subscriber import EventSource, KVEventSubscriber

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


def _subscriber() -> tuple[KVEventSubscriber, BlockIndex, GatewayMetrics]:
    index, metrics = BlockIndex(), GatewayMetrics()
    source = EventSource("fuzz", "127.0.0.1", 1, None, "", None)
    sub = KVEventSubscriber(R, source, NS, index, None, None, metrics)  # type: ignore[arg-type]
    return sub, index, metrics


def _held(index: BlockIndex, tokens: list[int]) -> int:
    return index.match(block_keys(tokens, NS), [R])[R]


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(payload=mutated_batch())
def test_mutated_batches_never_cost_the_replica_its_index(payload):
    sub, index, _ = _subscriber()
    base = msgspec.msgpack.encode([1.0, [stored(BASE_HASHES, BASE)], 0])
    assert sub._ingest(0, base) == ([], 1)
    errors, _ = sub._ingest(1, payload)  # must not raise, whatever the payload
    assert _held(index, BASE) == 3
    full = msgspec.msgpack.decode(payload) if _decodes(payload) else None
    if full is not None and isinstance(full[1], list):
        # The well-formed event in the batch was applied, mutated neighbours or not.
        assert _held(index, PROBE) == 2, errors
    # The replica goes on: a later well-formed child of the base chain still lands.
    child = msgspec.msgpack.encode(
        [2.0, [stored([b"base-block-0004!!"], [13, 14, 15, 16], parent=BASE_HASHES[-1])], 0]
    )
    assert sub._ingest(2, child) == ([], 1)
    assert _held(index, [*BASE, 13, 14, 15, 16]) == 4


def _decodes(payload: bytes) -> bool:
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return False
    return isinstance(raw, list) and len(raw) >= 2


def _bad(event: object, ts: object = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, [event], 0])


# The four inputs issue 13 found to kill a subscriber, each with the reason it is counted under.
KNOWN_BAD = {
    "bad_block_hashes": _bad(stored([[1]], [1, 2, 3, 4])),
    "bad_token_ids": _bad(stored([9], [1, 2, 3, 2**32])),
    "bad_extra_keys": _bad(stored([9], [1, 2, 3, 4], extra_keys=[[{"a": 1}]])),
    "bad_ts": _bad(stored([9], [1, 2, 3, 4]), ts="yesterday"),
    "not_msgpack": b"\xc1\xc1",
}


@settings(
    max_examples=3,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batches=st.lists(mutated_batch(), min_size=200, max_size=200))
def test_mutated_batches_over_zmq_keep_the_subscriber_and_the_index(batches):

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
                await _until(lambda: sub.last_seq == len(sent) - 1, timeout=30)
                assert not task.done()
                assert _held(index, BASE) == 3
                assert _count(metrics, "kvgate_event_resyncs_total") == 1  # the start only
                reasons = metrics.registry.get_sample_value
                assert (
                    sum(
                        reasons("kvgate_event_errors_total", {"reason": r}) or 0
                        for r in ("bad_block_hashes", "bad_token_ids", "not_msgpack", "bad_ts")
                    )
                    > 0
                )
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                pub.close(linger=0)
        ctx.term()

    asyncio.run(main())
