"""Block keys and the match clamp: golden vectors, extra-key effects, span-aware clamping."""

from __future__ import annotations

import pytest

from cachekey import HashNamespace, MMItem, block_extra_keys, block_keys, clamp_match, hash_block

NS = HashNamespace(model="demo", block_size=4, seed="kvgate-v1")
TOKENS = list(range(100, 118))  # 4 full blocks of 4 and a partial tail of 2

# Frozen once from the implementation: a silent change of the hashing must fail here.
GOLDEN_ROOT = "ac19d29dd5a6d7898c4b3c2a56035169"
GOLDEN_PLAIN = [
    "4aefff5f942d2709a995980afc91916d",
    "86e4eed29d7ca8014f3767be598b0cf2",
    "08a72c0612ad28e79883afd1f37ee629",
    "b98ab3a59280cdb5ab16c50bf236a973",
]
GOLDEN_MM_LORA_SALT = [
    "0bdc14e782dbe06c32bafc22ddf57396",
    "9b07081145f86a4640e36f9973c35dbb",
    "9610dcc5a0dcc00c0f8b1b91805105e0",
    "ded926ba436717fbc3fe5d276533248a",
]


def test_golden_root_and_plain_keys():
    assert NS.root().hex() == GOLDEN_ROOT
    assert [k.hex() for k in block_keys(TOKENS, NS)] == GOLDEN_PLAIN


def test_golden_keys_with_image_lora_and_salt():
    items = [MMItem("img-a", "image", 3, 6)]
    keys = block_keys(TOKENS, NS, items, lora_name="adapter-1", cache_salt="tenant-9")
    assert [k.hex() for k in keys] == GOLDEN_MM_LORA_SALT


def test_only_full_blocks_are_keyed_and_keys_chain():
    keys = block_keys(TOKENS, NS)
    assert len(keys) == len(TOKENS) // NS.block_size
    assert all(len(k) == 16 for k in keys)
    parent = NS.root()
    for i, key in enumerate(keys):
        parent = hash_block(parent, TOKENS[i * 4 : (i + 1) * 4], ())
        assert key == parent


def test_incremental_keys_equal_full_keys():
    full = block_keys(TOKENS, NS)
    tail = block_keys(TOKENS, NS, start_block=2, parent=full[1])
    assert tail == full[2:]
    with pytest.raises(ValueError):
        block_keys(TOKENS, NS, start_block=1)


def test_namespace_changes_every_key():
    base = block_keys(TOKENS, NS)
    for ns in (
        HashNamespace("other", 4, "kvgate-v1"),
        HashNamespace("demo", 4, "seed-2"),
    ):
        assert not set(block_keys(TOKENS, ns)) & set(base)


@pytest.mark.parametrize(
    "kwargs", [{"lora_name": "a"}, {"cache_salt": "s"}, {"lora_name": "a", "cache_salt": "s"}]
)
def test_lora_or_salt_changes_every_key(kwargs):
    base = block_keys(TOKENS, NS)
    other = block_keys(TOKENS, NS, **kwargs)
    assert all(a != b for a, b in zip(base, other, strict=True))
    lora_b = block_keys(TOKENS, NS, lora_name="b", cache_salt=kwargs.get("cache_salt"))
    assert all(a != b for a, b in zip(other, lora_b, strict=True))


def test_salt_only_on_block_zero_and_lora_on_every_block():
    assert block_extra_keys(0, 4, (), "lora", "salt") == ("lora", "salt")
    assert block_extra_keys(1, 4, (), "lora", "salt") == ("lora",)


def test_mm_extra_keys_carry_offset_relative_to_block():
    item = MMItem("img", "image", 3, 6)  # tokens 3..8 span blocks 0, 1 and 2
    assert block_extra_keys(0, 4, [item]) == (("img", 3),)
    assert block_extra_keys(1, 4, [item]) == (("img", -1),)
    assert block_extra_keys(2, 4, [item]) == (("img", -5),)
    assert block_extra_keys(3, 4, [item]) == ()


def test_different_image_changes_keys_from_first_overlapping_block():
    a = block_keys(TOKENS, NS, [MMItem("img-a", "image", 5, 6)])
    b = block_keys(TOKENS, NS, [MMItem("img-b", "image", 5, 6)])
    # Block 0 ends before the span; block 1 is the first to overlap it.
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_same_image_at_another_offset_changes_keys():
    a = block_keys(TOKENS, NS, [MMItem("img", "image", 4, 4)])
    b = block_keys(TOKENS, NS, [MMItem("img", "image", 5, 4)])
    assert a[0] == b[0] and a[1] != b[1]


BS = 4


@pytest.mark.parametrize(
    ("matched", "n_tokens", "spans", "expected"),
    [
        (12, 20, [], 12),  # no spans: whole blocks kept
        (14, 20, [], 12),  # partial block rounded down
        (20, 20, [], 16),  # full match keeps one token to compute: ((20-1)//4)*4
        (16, 16, [], 12),  # prompt exactly on a block boundary
        (3, 3, [], 0),  # shorter than one block
        (12, 20, [(4, 4)], 12),  # span [4, 8) ends at a boundary before the match end
        (12, 20, [(8, 4)], 12),  # span [8, 12) ends exactly at the match end
        (12, 20, [(12, 4)], 12),  # span starts exactly at the match end
        (12, 20, [(10, 4)], 8),  # span [10, 14) crosses the end: rewind to 10 -> 8
        (12, 20, [(5, 10)], 4),  # span [5, 15) covers the end: rewind to 5 -> 4
        (16, 24, [(2, 4), (6, 12)], 0),  # rewind to 6 -> 4 lands inside [2, 6): -> 0
        (16, 24, [(1, 2), (6, 12)], 4),  # rewind to 6 -> 4; [1, 3) is wholly before 4
        (20, 20, [(17, 3)], 16),  # keep-one-token cap lands at 16, before the span
        (20, 20, [(14, 6)], 12),  # cap 16 is inside [14, 20): rewind to 14 -> 12
    ],
)
def test_clamp_match(matched, n_tokens, spans, expected):
    items = [MMItem(f"i{k}", "image", off, ln) for k, (off, ln) in enumerate(spans)]
    got = clamp_match(matched, n_tokens, BS, items)
    assert got == expected
    assert (got % BS == 0 and got < n_tokens) or n_tokens == 0
    assert not any(it.offset < got < it.end for it in items)


@pytest.mark.parametrize(
    ("matched", "n_tokens", "spans", "clamped", "partial"),
    [
        (12, 20, [(10, 4)], 8, 12),  # span [10, 14) crosses the end: only "clamp" rewinds
        (12, 20, [(5, 10)], 4, 12),  # span [5, 15) covers the end
        (14, 20, [(10, 4)], 8, 12),  # both round down to whole blocks
        (20, 20, [(14, 6)], 12, 16),  # both leave one token to compute
        (12, 20, [], 12, 12),  # no spans: the rules agree
    ],
)
def test_usable_match_rules(matched, n_tokens, spans, clamped, partial):
    from cachekey import usable_match

    items = [MMItem(f"i{k}", "image", off, ln) for k, (off, ln) in enumerate(spans)]
    assert usable_match(matched, n_tokens, BS, items, "clamp") == clamped
    assert usable_match(matched, n_tokens, BS, items, "partial") == partial


def test_prefix_header_parses_only_a_whole_key_in_hex() -> None:
    from cachekey import parse_prefix_header

    key = block_keys(list(range(32)), HashNamespace("m", 16))[-1]
    assert parse_prefix_header(key.hex()) == key
    assert parse_prefix_header(key.hex().upper()) == key
    for bad in ("", key.hex()[:-2], key.hex() + "00", "zz" * 16, " " + key.hex()[1:]):
        assert parse_prefix_header(bad) is None
