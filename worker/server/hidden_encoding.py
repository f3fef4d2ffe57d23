"""Hidden states on the wire: base64 of little-endian float32, never a JSON list of floats.

`return_hidden_states` puts on each choice

    "hidden_states": {"dtype": "float32", "shape": [rows, tokens, hidden], "layers": [...],
                      "data": "<base64>"}

where row r holds Hugging Face's `hidden_states[layers[r]]` (the last row is the final, normed
output) and token t is the t-th token the model ran (the prompt, then every generated token but
the last). Decode with `np.frombuffer(base64.b64decode(data), "<f4").reshape(shape)`.
Embeddings use OpenAI's own `encoding_format: "base64"`: the same bytes for one vector.
"""

from __future__ import annotations

import base64

import numpy as np

from cachekey.openai.errors import APIError


def b64_floats(array: np.ndarray) -> str:
    """base64 of the array's values as little-endian float32, in C order."""
    return base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode("ascii")


def encode_hidden_states(array: np.ndarray, layers: tuple[int, ...]) -> dict:
    return {
        "dtype": "float32",
        "shape": list(array.shape),
        "layers": list(layers),
        "data": b64_floats(array),
    }


def require_hidden_cache(layers: tuple[int, ...], what: str, param: str) -> None:
    """`what` needs the hidden states of prompt tokens that a prefix hit skips: refuse it on a
    worker without the cache (`layers`, the kept rows, is empty then)."""
    if not layers:
        raise APIError(
            400,
            f"{what} needs the hidden state of every prompt token; this worker runs without "
            "--hidden-state-cache",
            param=param,
            code="hidden_state_cache_disabled",
        )
