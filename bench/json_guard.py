"""Memory and time of parsing a request body: `json.loads` (before) vs the gateway's guard.

For each body, side by side in one process: the peak memory allocated while parsing (tracemalloc:
Python objects, numpy buffers, msgspec) and the wall time, of
  before: json.loads(body), what the gateway did until issue 14;
  after:  cachekey.json_shape.decode_json(body, 64, 1_000_000): depth and element bounds measured
          on the raw bytes, then msgspec's decoder; a body past a bound is refused unparsed.
The body's own bytes are allocated before measuring and not counted. Memory is taken from one
traced run, time from untraced runs (tracing slows allocation-heavy parses many times over).

    .venv/bin/python -m bench.json_guard [--repeats 3] [--out bench/results/json_guard.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import platform
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.report import Col, args_dict, print_table, write_json
from cachekey.json_shape import JSONShapeError, decode_json

MiB = 2**20
HELLO = '{"role": "user", "content": "hi"}'


def many_keys(size: int) -> bytes:
    n = (size - 2) // 13
    return b"{" + b",".join(b'"k%07d":0' % i for i in range(n)) + b"}"


def many_objects(size: int) -> bytes:
    n = (size - 100) // 3
    head = b'{"model": "demo", "messages": [' + HELLO.encode() + b'], "x": ['
    return head + b",".join([b"{}"] * n) + b"]}"


def deep(size: int) -> bytes:
    depth = size // 2
    return b'{"messages": [' + HELLO.encode() + b'], "x": ' + b"[" * depth + b"]" * depth + b"}"


def chat_with_image(size: int) -> bytes:
    """A real-shaped chat: one big base64 image and a few turns (accepted by both)."""
    image = base64.b64encode(bytes(range(256)) * (size * 3 // 4 // 256)).decode()
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "describe"}]}]
    return json.dumps({"model": "demo", "messages": messages * 1, "max_tokens": 64}).encode()


def small_chat(_: int) -> bytes:
    turns = [{"role": r, "content": "a short turn " * 20} for r in ("user", "assistant") * 8]
    return json.dumps({"model": "demo", "messages": turns, "max_tokens": 64}).encode()


BODIES: tuple[tuple[str, Callable[[int], bytes], int], ...] = (
    ("32 MiB {k: 0, ...} (3M keys)", many_keys, 32 * MiB - 1024),
    ("32 MiB [{}, {}, ...] (11M objects)", many_objects, 32 * MiB - 1024),
    ("nesting 100,000 deep", deep, 200_000),
    ("8 MiB chat with one image", chat_with_image, 8 * MiB),
    ("small chat (16 turns)", small_chat, 0),
)


@dataclass(slots=True)
class Row:
    body: str
    mib: float
    before_peak_mib: float | None
    before_ms: float | None
    before: str
    after_peak_mib: float
    after_ms: float
    after: str
    memory_ratio: float | None


def _run(fn: Callable[[], object]) -> str:
    try:
        fn()
    except JSONShapeError as e:
        return e.code
    except (RecursionError, ValueError) as e:
        return type(e).__name__
    return "ok"


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, float, str]:
    """(peak MiB of one traced run, median ms of `repeats` untraced runs, outcome)."""
    tracemalloc.start()
    outcome = _run(fn)
    peak = tracemalloc.get_traced_memory()[1] / MiB
    tracemalloc.stop()  # tracing slows allocation-heavy parses many times over: time apart
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _run(fn)
        times.append((time.perf_counter() - t0) * 1000)
    return peak, statistics.median(times), outcome


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench/results/json_guard.json"))
    args = p.parse_args()
    rows = []
    for name, make, size in BODIES:
        raw = make(size)
        before = measure(lambda raw=raw: json.loads(raw), args.repeats)
        after = measure(lambda raw=raw: decode_json(raw, 64, 1_000_000), args.repeats)
        ratio = before[0] / after[0] if after[0] else None
        rows.append(Row(name, len(raw) / MiB, *before, *after, ratio))
    print_table(
        rows,
        [
            Col("body", "body", 36, left=True),
            Col("mib", "MiB", 7, ".1f"),
            Col("before_peak_mib", "before peak", 13, ".1f", " MiB"),
            Col("before_ms", "ms", 9, ".0f"),
            Col("before", "outcome", 16),
            Col("after_peak_mib", "after peak", 13, ".1f", " MiB"),
            Col("after_ms", "ms", 9, ".0f"),
            Col("after", "outcome", 16),
            Col("memory_ratio", "mem ratio", 11, ".1f", "x"),
        ],
    )
    write_json(
        args.out,
        {
            "args": args_dict(args),
            "machine": platform.platform(),
            "rows": [asdict(r) for r in rows],
        },
    )


if __name__ == "__main__":
    main()
