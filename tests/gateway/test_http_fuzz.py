"""Property-based fuzzing of the gateway's HTTP API over real processes (hypothesis).

Random and semi-valid chat/completion bodies (wrong types, huge numbers, nested junk, bad
images, unicode, empty arrays, truncated JSON, wrong content types; nesting thousands deep,
lone UTF-16 surrogates, numbers as strings or decimals, huge unknown fields) go to a real
gateway in front of a real `sim` worker. Every answer must come within a few seconds and never
be a 5xx (the cluster is healthy, so not even a 503), and a 4xx must carry an OpenAI error body.
At the end the worker must still be healthy (no input killed its engine).

The suite runs 150 examples; `KVGATE_FUZZ_EXAMPLES=2000` runs a bigger one by hand
(docs/reliability.md has the figures).
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from harness.cluster import Cluster, ClusterSpec

pytestmark = [pytest.mark.slow, pytest.mark.long]

EXAMPLES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "150"))
ANSWER_WITHIN_S = 10.0


def _png_data_url(size: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 90)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGE_URLS = st.sampled_from(
    [
        _png_data_url(8),
        _png_data_url(64),
        "data:image/png;base64,AAAA",
        "data:image/png;base64,!!!not-base64!!!",
        "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode(),
        "data:,",
        "data:text/plain,hello",
        "http://127.0.0.1:1/refused.png",  # nothing listens: a fast, clear failure
        "file:///etc/passwd",
        "ftp://example.invalid/x.png",
        "",
    ]
) | st.text(max_size=40)

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def mostly(valid: st.SearchStrategy, junk: st.SearchStrategy) -> st.SearchStrategy:
    """Three parts valid to one part junk, so bodies get past validation often enough."""
    return st.one_of(valid, valid, valid, junk)


# Numbers that break naive code: negatives, zero, past int32/int64, floats, strings.
WEIRD_INT = (
    st.integers(min_value=-3, max_value=48)
    | st.sampled_from([0, -1, 2**31, 2**63, 10**30])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5)
)
TEXT = st.text(max_size=200) | st.sampled_from(
    ["", "\u0000", "<image>", "\ud7ff\U0010ffff", "é" * 300]
)

TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": mostly(TEXT, JSON)})
IMAGE_PART = st.fixed_dictionaries(
    {
        "type": st.just("image_url"),
        "image_url": mostly(st.fixed_dictionaries({"url": IMAGE_URLS}), JSON),
    },
    optional={"uuid": mostly(st.text(min_size=1, max_size=10), JSON)},
)
PART = mostly(TEXT_PART | IMAGE_PART, st.dictionaries(st.text(max_size=8), JSON, max_size=3))
MESSAGE = mostly(
    st.fixed_dictionaries(
        {
            "role": mostly(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=8)),
            "content": mostly(TEXT | st.lists(PART, min_size=1, max_size=3), JSON),
        }
    ),
    JSON,
)
SAMPLING = {
    "max_tokens": mostly(st.integers(min_value=1, max_value=32), WEIRD_INT),
    "max_completion_tokens": WEIRD_INT,
    "n": mostly(
        st.integers(min_value=1, max_value=3),
        st.sampled_from([0, -1, 2**31, 10**30, "64", 64.0, 2.0, True, "2", None]),
    ),
    "temperature": mostly(st.floats(min_value=0, max_value=2), WEIRD_INT),
    "top_p": mostly(st.floats(min_value=0.01, max_value=1), WEIRD_INT),
    "top_k": WEIRD_INT,
    "seed": mostly(st.integers(min_value=0, max_value=2**32), WEIRD_INT),
    "stream": mostly(st.booleans(), JSON),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON),
    "stop": mostly(st.lists(st.text(min_size=1, max_size=4), max_size=2), JSON),
    "cache_salt": mostly(st.text(min_size=1, max_size=12), JSON),
    "logprobs": JSON,
    "ignore_eos": mostly(st.booleans(), JSON),
}
CHAT = st.fixed_dictionaries(
    {
        "model": mostly(st.just("demo"), JSON),
        "messages": mostly(st.lists(MESSAGE, min_size=1, max_size=4), JSON),
    },
    optional={**SAMPLING, "tools": JSON, "chat_template_kwargs": JSON, "junk": JSON},
)
COMPLETION = st.fixed_dictionaries(
    {
        "model": mostly(st.just("demo"), JSON),
        "prompt": mostly(
            TEXT | st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=20),
            st.lists(st.integers(min_value=-10, max_value=300_000), max_size=20)
            | st.lists(st.lists(st.integers(min_value=0, max_value=100), max_size=5), max_size=3)
            | JSON,
        ),
    },
    optional=SAMPLING,
)
CONTENT_TYPES = st.sampled_from(
    ["application/json", "text/plain", "application/x-www-form-urlencoded", "", "image/png"]
)


# Well-formed bodies (the content may still be bad: images, unicode, token ids), to mutate.
VALID_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": TEXT | st.lists(TEXT_PART | IMAGE_PART, min_size=1, max_size=3),
    }
)
VALID_SAMPLING = {
    "max_tokens": st.integers(min_value=1, max_value=32),
    "n": st.integers(min_value=1, max_value=3),
    "temperature": st.floats(min_value=0, max_value=2),
    "seed": st.integers(min_value=0, max_value=2**32),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "cache_salt": st.text(min_size=1, max_size=12),
    "ignore_eos": st.booleans(),
}
VALID_CHAT = st.fixed_dictionaries(
    {"model": st.just("demo"), "messages": st.lists(VALID_MESSAGE, min_size=1, max_size=3)},
    optional=VALID_SAMPLING,
)
VALID_COMPLETION = st.fixed_dictionaries(
    {
        "model": st.just("demo"),
        "prompt": TEXT | st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=20),
    },
    optional=VALID_SAMPLING,
)
MUTABLE_KEYS = [*SAMPLING, "model", "messages", "prompt", "tools", "top_k", "logprobs"]
# Numbers in the shapes that passed type-blind limit checks (issue 14): strings, decimals.
WRONG_TYPED = st.sampled_from(["64", "40000", 64.0, 1e3, "1", True, [64], {"n": 64}, "-1"])
# Escaped lone surrogates, a valid pair, and raw bytes that are not UTF-8 (a surrogate encoded
# as UTF-8, a lone continuation byte).
BAD_TEXT = st.sampled_from(
    [b"\\ud800", b"\\udfff", b"a\\ud800b", b"\\ud800\\ud800", b"\\ud83d\\ude00",
     b"\xed\xa0\x80", b"\x80", b"\\\\ud800"]
)  # fmt: skip


TYPED_FIELDS = ["n", "max_tokens", "max_completion_tokens", "seed", "temperature", "top_p",
                "top_k", "logprobs", "stream"]  # fmt: skip


def _deep(depth: int, kind: str) -> bytes:
    if kind == "array":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@st.composite
def hostile_bodies(draw: st.DrawFn, body: dict) -> bytes:
    """A valid body with one hostile part: deep nesting, bad text, a wrong type, a huge field."""
    kind = draw(st.sampled_from(["deep", "text", "typed", "huge"]))
    if kind == "typed":
        field = draw(st.sampled_from(TYPED_FIELDS))
        return json.dumps({**body, field: draw(WRONG_TYPED)}).encode()
    data = json.dumps({**body, "junk": "@@JUNK@@"}).encode()
    if kind == "deep":
        depth = draw(st.sampled_from([10, 64, 65, 999, 5_000, 100_000]))
        hole = _deep(depth, draw(st.sampled_from(["array", "object"])))
        return data.replace(b'"@@JUNK@@"', hole)
    if kind == "text":
        return data.replace(b"@@JUNK@@", draw(BAD_TEXT))
    size = draw(st.sampled_from([2**20, 8 * 2**20, 16 * 2**20]))
    return data.replace(b"@@JUNK@@", b"x" * size)


@st.composite
def raw_requests(draw: st.DrawFn) -> tuple[str, bytes, str]:
    """(path, body bytes, content type): valid, mutated, random, truncated or binary bodies."""
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    shape = draw(
        st.sampled_from(
            ["valid", "mutated", "mutated", "random", "truncated", "binary", "other", "hostile"]
        )
    )
    body = draw(VALID_CHAT if chat else VALID_COMPLETION)
    if shape == "mutated":
        key = draw(st.sampled_from(MUTABLE_KEYS) | st.text(max_size=6))
        if draw(st.integers(0, 4)) == 0:
            body.pop(key, None)
        else:
            body[key] = draw(WEIRD_INT | JSON)
    elif shape == "random":
        body = draw(CHAT if chat else COMPLETION)
    data = json.dumps(body).encode()
    if shape == "truncated":
        data = data[: draw(st.integers(min_value=0, max_value=max(len(data) - 1, 0)))]
    elif shape == "binary":
        data = draw(st.binary(max_size=200))
    elif shape == "other":
        data = json.dumps(draw(JSON)).encode()
    elif shape == "hostile":
        data = draw(hostile_bodies(body))
    ctype = draw(CONTENT_TYPES) if draw(st.integers(0, 4)) == 0 else "application/json"
    return path, data, ctype


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=512,
        gateway_args=("--poll-interval", "0.5", "--request-timeout", "8"),
        log_dir=tmp_path_factory.mktemp("fuzz"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def outcomes() -> Counter:
    """Status codes seen by the fuzz (checked afterwards: the fuzz must reach both sides)."""
    return Counter()


def _check(resp: httpx.Response, body: bytes) -> None:
    status = resp.status_code
    # The cluster is healthy and idle, so even a 503 means an input broke something (the first
    # bug this found: a worker 500 on a huge seed got the worker ejected -> "no healthy worker").
    assert status < 500, (status, body[:500])
    if status >= 400:
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"]
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [ln for ln in body.decode().splitlines() if ln.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    else:
        assert "choices" in json.loads(body)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(req=raw_requests())
def test_gateway_never_5xx_or_hangs(
    cluster: Cluster, outcomes: Counter, req: tuple[str, bytes, str]
) -> None:
    path, data, ctype = req
    headers = {"content-type": ctype} if ctype else {}
    t0 = time.monotonic()
    with httpx.stream(
        "POST",
        f"{cluster.gateway_url}{path}",
        content=data,
        headers=headers,
        timeout=ANSWER_WITHIN_S,
    ) as resp:
        body = resp.read()
    assert time.monotonic() - t0 < ANSWER_WITHIN_S
    outcomes[resp.status_code] += 1
    _check(resp, body)


@pytest.mark.parametrize(("seed", "n"), [(2**63, 1), (-(2**63) - 1, 1)])
def test_found_by_fuzzing_seed_past_int64_is_a_400(cluster: Cluster, seed: int, n: int) -> None:
    # Once a worker 500 (its seed packing overflowed), retried on every replica and ejecting them.
    # (The largest seed with n 2 is served now: choice i's seed wraps within int64,
    # tests/gateway/test_bodies.py.)
    body = {"model": "demo", "prompt": "hello", "max_tokens": 1, "seed": seed, "n": n}
    for _ in range(4):  # more than --eject-after-failures
        r = httpx.post(f"{cluster.gateway_url}/v1/completions", json=body, timeout=10)
        assert r.status_code == 400, r.text
        assert "seed" in r.json()["error"]["message"]
    ok = {**body, "seed": 2**63 - 1, "n": 1}
    assert (
        httpx.post(f"{cluster.gateway_url}/v1/completions", json=ok, timeout=10).status_code == 200
    )


def test_worker_survived_the_fuzz(cluster: Cluster, outcomes: Counter) -> None:
    # Runs after the fuzz in file order: no input may have killed the engine or the gateway.
    print("fuzz outcomes by status:", dict(sorted(outcomes.items())))
    if outcomes:  # the fuzz ran in this session: it must have reached both outcomes
        assert outcomes[200] > 0 and sum(n for s, n in outcomes.items() if s >= 400) > 0
    assert httpx.get(f"{cluster.workers[0].url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{cluster.gateway_url}/health", timeout=5).status_code == 200
    r = httpx.post(
        f"{cluster.gateway_url}/v1/completions",
        json={"model": "demo", "prompt": "still alive?", "max_tokens": 2},
        timeout=10,
    )
    assert r.status_code == 200
