"""cachekey: the contract shared by the gateway and the workers.

request -> Prompt (render) -> block keys (keys) -> KV events (events), the documents a worker
serves the gateway (documents), the OpenAI API both validate and answer with (openai/) and every
`x-*` header between them (headers). No torch, no web framework: the gateway and the worker import
exactly this code, so their keys, errors and wire names cannot drift apart.
"""

from cachekey.assets import AssetError, ImageConfig, ModelAssets
from cachekey.errors import (
    ImageFetchError,
    ImageTooLargeError,
    InvalidImageError,
    PromptTooLongError,
    RenderError,
    TemplateError,
    TooManyImagesError,
    UnsupportedContentError,
)
from cachekey.headers import PREFIX_HEADER
from cachekey.images import (
    IGNORE_UUIDS,
    ClientUuids,
    decode_data_url,
    image_identifier,
    probe_image,
    scoped_uuid_identifier,
)
from cachekey.keys import (
    DEFAULT_HASH_SEED,
    HashNamespace,
    MMMatchRule,
    block_extra_keys,
    block_keys,
    clamp_match,
    encode_extra_keys,
    hash_block,
    parse_prefix_header,
    root_key,
    usable_match,
)
from cachekey.render import ImageOptions, Renderer, RenderLimits
from cachekey.types import BlockKey, ExtraKey, MMItem, Prompt

__all__ = [
    "DEFAULT_HASH_SEED",
    "IGNORE_UUIDS",
    "PREFIX_HEADER",
    "AssetError",
    "BlockKey",
    "ClientUuids",
    "ExtraKey",
    "HashNamespace",
    "ImageConfig",
    "ImageFetchError",
    "ImageOptions",
    "ImageTooLargeError",
    "InvalidImageError",
    "MMItem",
    "MMMatchRule",
    "ModelAssets",
    "Prompt",
    "PromptTooLongError",
    "RenderError",
    "RenderLimits",
    "Renderer",
    "TemplateError",
    "TooManyImagesError",
    "UnsupportedContentError",
    "block_extra_keys",
    "block_keys",
    "clamp_match",
    "decode_data_url",
    "encode_extra_keys",
    "hash_block",
    "image_identifier",
    "parse_prefix_header",
    "probe_image",
    "root_key",
    "scoped_uuid_identifier",
    "usable_match",
]
