"""KV-event decoding: both vLLM encodings, int and bytes hashes, tolerance of unknown data.

The payloads are built by a minimal msgpack writer in this file (not by msgspec), so the test
pins the wire bytes a vLLM publisher sends rather than our own encoder's round trip.
"""

from __future__ import annotations

import json
import struct

import msgspec
import pytest

from cachekey.events import (
    END_SEQ,
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_batch,
    encode_batch,
    parse_replay_reply,
    replay_reply,
    seq_bytes,
    seq_from_bytes,
    topic,
)
from tests.support.paths import FIXTURES


def mp(v) -> bytes:
    """Minimal msgpack writer for the types the event schema uses."""
    if v is None:
        return b"\xc0"
    if isinstance(v, bool):
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        if 0 <= v < 128:
            return bytes([v])
        if 0 <= v < 2**64:
            return b"\xcf" + struct.pack(">Q", v)
        return b"\xd3" + struct.pack(">q", v)
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        raw = v.encode()
        assert len(raw) < 256
        return (bytes([0xA0 | len(raw)]) if len(raw) < 32 else b"\xd9" + bytes([len(raw)])) + raw
    if isinstance(v, bytes):
        return b"\xc4" + bytes([len(v)]) + v
    if isinstance(v, list | tuple):
        assert len(v) < 16
        return bytes([0x90 | len(v)]) + b"".join(mp(x) for x in v)
    if isinstance(v, dict):
        assert len(v) < 16
        return bytes([0x80 | len(v)]) + b"".join(mp(k) + mp(x) for k, x in v.items())
    raise TypeError(v)


H1, H2 = 0x1122334455667788, 0xF0E0D0C0B0A09080  # vLLM int hashes: the low 64 bits, unsigned
B1, B2 = bytes(range(16)), bytes(range(16, 32))
TOKENS = list(range(1, 9))
EXTRA = [[["img", 3]], None]


def positional(h1, h2) -> bytes:
    return mp(
        [
            1700000000.5,
            [
                ["BlockStored", [h1, h2], None, TOKENS, 4, None, "GPU", "lora-a", EXTRA],
                [
                    "BlockStored",
                    [h2],
                    h1,
                    [9, 10, 11, 12],
                    4,
                    None,
                    "GPU",
                    None,
                    None,
                    0,
                    "full_attention",
                ],
                ["BlockRemoved", [h1], "GPU"],
                ["SomethingNew", 1, 2, 3],
                ["AllBlocksCleared"],
            ],
            2,
        ]
    )


def tagged(h1, h2) -> bytes:
    stored = {
        "type": "BlockStored",
        "block_hashes": [h1, h2],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": "lora-a",
        "extra_keys": EXTRA,
    }
    child = {
        "type": "BlockStored",
        "block_hashes": [h2],
        "parent_block_hash": h1,
        "token_ids": [9, 10, 11, 12],
        "block_size": 4,
        "medium": "GPU",
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    return mp(
        {
            "ts": 1700000000.5,
            "events": [
                stored,
                child,
                {"type": "BlockRemoved", "block_hashes": [h1], "medium": "GPU"},
                {"type": "SomethingNew", "field": 1},
                {"type": "AllBlocksCleared"},
            ],
            "data_parallel_rank": 2,
            "future_batch_field": "ignored",
        }
    )


def expected(h1, h2) -> list:
    return [
        BlockStored([h1, h2], None, TOKENS, 4, None, "GPU", "lora-a", [(("img", 3),), None]),
        BlockStored([h2], h1, [9, 10, 11, 12], 4, None, "GPU", None, None, 0, "full_attention"),
        BlockRemoved([h1], "GPU"),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize(("h1", "h2"), [(H1, H2), (B1, B2)], ids=["int-hashes", "bytes-hashes"])
@pytest.mark.parametrize("encode", [positional, tagged], ids=["positional", "tagged"])
def test_both_encodings_decode_to_the_same_events(encode, h1, h2):
    batch = decode_batch(encode(h1, h2))
    assert batch.ts == 1700000000.5
    assert batch.data_parallel_rank == 2
    assert batch.events == expected(h1, h2)
    assert batch.events[0].extra_keys[0] == (("img", 3),)  # tuples, not msgpack lists


def test_literal_bytes_of_a_tiny_positional_batch():
    # [0.0, [["AllBlocksCleared"], ["BlockRemoved", [7], "GPU"]]] written out byte by byte.
    payload = bytes.fromhex(
        "92" "cb0000000000000000" "92" "91b0" + b"AllBlocksCleared".hex()
        + "93ac" + b"BlockRemoved".hex() + "9107" "a3" + b"GPU".hex()
    )  # fmt: skip
    batch = decode_batch(payload)
    assert batch.events == [AllBlocksCleared(), BlockRemoved([7], "GPU")]
    assert batch.data_parallel_rank is None


def test_our_encoding_round_trips_with_bytes_keys():
    events = expected(B1, B2)
    batch = decode_batch(encode_batch(events, dp_rank=1))
    assert batch.events == events and batch.data_parallel_rank == 1


def _keys_vllm_always_sends() -> dict[str, frozenset[str]]:
    """Per event type, the keys of every event vLLM 0.33.0 published in the recorded scenarios
    (its replay buffers' raw payloads)."""
    seen: dict[str, list[frozenset[str]]] = {}
    for path in sorted((FIXTURES / "vllm_0_33").rglob("*.json")):
        for frames in json.loads(path.read_text()).get("replay_from_0") or []:
            if len(frames) == 4 and frames[3]:
                for event in msgspec.msgpack.decode(bytes.fromhex(frames[3]))[1]:
                    seen.setdefault(event["type"], []).append(frozenset(event))
    return {kind: frozenset.intersection(*keys) for kind, keys in seen.items()}


def test_our_events_carry_every_key_vllm_sends():
    """vLLM's decoder (its msgspec structs) refuses an event without `lora_id`, `medium` or
    `lora_name`, which have no default there: a kvgate worker's events must carry them, also
    when they hold the defaults (a GPU block, no LoRA)."""
    vllm = _keys_vllm_always_sends()
    assert {"lora_id", "medium", "lora_name"} <= vllm["BlockStored"]
    assert "medium" in vllm["BlockRemoved"]
    ours = [
        BlockStored([B1], None, TOKENS[:4], 4, extra_keys=[None]),
        BlockRemoved([B1]),
        BlockStored([B1], None, TOKENS[:4], 4, medium="CPU", lora_name="a", extra_keys=[("a",)]),
        BlockRemoved([B1], medium="CPU"),
    ]
    for event in msgspec.msgpack.decode(encode_batch(ours))[1]:
        missing = vllm[event["type"]] - set(event)
        assert not missing, f"{event['type']} leaves out {sorted(missing)}"


@pytest.mark.parametrize("payload", [b"\xc1", mp(5), mp([1.0]), mp({"ts": 1.0})])
def test_garbage_is_a_decode_error(payload):
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_a_malformed_event_is_skipped_with_its_reason_and_the_rest_kept():
    good = ["BlockRemoved", [7], "GPU"]
    bad = [
        ["BlockStored", 1],  # an int where the hash list goes
        ["BlockStored", [[1]], None, [1, 2, 3, 4], 4],  # a list as a hash
        ["BlockStored", [1], None, [1, 2, 3, 2**32], 4],  # a token id past 32 bits
        ["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU", None, [[{"a": 1}]]],  # a map
        ["BlockStored", [1], None, [1, 2, 3], 4],  # 3 tokens for one block of 4
        {"type": "SomethingNew"},
        "not an event",
    ]
    batch = decode_batch(mp(["yesterday", [bad[0], good, *bad[1:], good], 0]))
    assert batch.events == [BlockRemoved([7], "GPU")] * 2
    assert batch.errors == [
        "bad_ts",
        "bad_block_hashes",
        "bad_block_hashes",
        "bad_token_ids",
        "bad_extra_keys",
        "length_mismatch",
        "unknown_event",
        "not_an_event",
    ]


def test_seq_and_topic_helpers():
    assert seq_bytes(0) == b"\x00" * 8 and seq_from_bytes(seq_bytes(12345)) == 12345
    assert seq_from_bytes(END_SEQ) == -1
    assert topic("abc", "demo") == "kv@abc@demo"


def test_replay_replies_in_both_vllm_layouts():
    # vLLM 0.33 (PR #45177): [b"", topic, seq, payload]; before it: [b"", seq, payload].
    assert parse_replay_reply([b"", b"kv@x", b"\x00" * 7 + b"\x05", b"p"]) == (5, b"p")
    assert parse_replay_reply([b"", b"\x00" * 7 + b"\x05", b"p"]) == (5, b"p")
    assert parse_replay_reply([b"", b"", END_SEQ, b""]) is None
    assert parse_replay_reply([b"", END_SEQ, b""]) is None
    assert replay_reply(b"kv@x", 5, b"p") == [b"", b"kv@x", b"\x00" * 7 + b"\x05", b"p"]
    assert parse_replay_reply(REPLAY_END) is None


@pytest.mark.parametrize(
    "frames",
    [[b""], [b"", b"x", b"y", b"z", b"w"], [b"x", seq_bytes(1), b"p"], [b"", b"\x01", b"p"]],
)
def test_malformed_replay_reply_is_a_decode_error(frames):
    with pytest.raises(DecodeError):
        parse_replay_reply(frames)
