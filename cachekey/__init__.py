"""cachekey: the contract shared by the gateway and the workers.

request -> Prompt (render) -> block keys (keys) -> KV events (events). No torch, no web framework:
the gateway and the worker import exactly this code, so their keys cannot drift apart.
"""

from cachekey.keys import (
    HashNamespace,
    block_extra_keys,
    block_keys,
    clamp_match,
    encode_extra_keys,
    hash_block,
    root_key,
)
from cachekey.types import BlockKey, ExtraKey, MMItem, Prompt

__all__ = [
    "BlockKey",
    "ExtraKey",
    "HashNamespace",
    "MMItem",
    "Prompt",
    "block_extra_keys",
    "block_keys",
    "clamp_match",
    "encode_extra_keys",
    "hash_block",
    "root_key",
]
