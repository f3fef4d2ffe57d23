"""Index ingestion and routing match, the BlockIndex of HEAD against a baseline, in one run.

The baseline is `gateway/index.py` at a git revision (default 369fa11, before the compact index),
loaded from `git show` into its own module, so both run on the same machine in the same process.
Ingestion: `BlockStored` events of 64 blocks with vLLM-style int hashes, re-hashed into gateway
keys, as `index.store` (blocks/s, wall and CPU time of the thread) and as the subscriber's
ingestion thread runs it, `decode_batch` of the msgpack payload then `index.apply`; best of 3
runs each. Memory per block is measured in a separate run under tracemalloc (tracing slows every
allocation about 3x, so it never runs while the rate is timed). Match: one replica holds the
prompt's prefix; `match` over 4 replicas for 8k and 32k-token prompts (median of 30).

    .venv/bin/python -m bench.index_ingest [--baseline REV] [--blocks N]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from cachekey.events import BlockStored, decode_batch, encode_batch
from cachekey.keys import HashNamespace, block_keys

NS = HashNamespace("demo", 16)


def load_baseline(rev: str):
    src = subprocess.run(
        ["git", "show", f"{rev}:gateway/index.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_index.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("baseline_index", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["baseline_index"] = mod
    spec.loader.exec_module(mod)
    return mod.BlockIndex


def chain(tokens: list[int], tag: int) -> BlockStored:
    n = len(tokens) // 16
    return BlockStored([tag * 10_000_000 + i for i in range(n)], None, tokens[: n * 16], 16)


def workload(num_blocks: int) -> list[BlockStored]:
    rng = random.Random(2)
    return [
        chain([rng.randrange(32_000) for _ in range(1024)], g + 1) for g in range(num_blocks // 64)
    ]


def ingestion(index_cls, events: list[BlockStored], num_blocks: int) -> dict:
    """Blocks per second of wall and of CPU time (best of 3), then bytes per block."""
    wall = cpu = 0.0
    for _ in range(3):
        index = index_cls(max_blocks=num_blocks * 2)
        t0, c0 = time.perf_counter(), time.thread_time()
        for ev in events:
            index.store("http://w0", NS, ev)
        c1, t1 = time.thread_time(), time.perf_counter()
        wall, cpu = max(wall, len(index) / (t1 - t0)), max(cpu, len(index) / (c1 - c0))
    del index
    tracemalloc.start()
    index = index_cls(max_blocks=num_blocks * 2)
    for ev in events:
        index.store("http://w0", NS, ev)
    measured, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"wall": wall, "cpu": cpu, "bytes_per_block": measured / len(index)}


def decode_and_apply(index_cls, payloads: list[bytes], num_blocks: int) -> dict:
    """Blocks per second of wall and of CPU time (best of 3) from msgpack payloads, as the
    subscriber's ingestion thread runs them: `decode_batch`, then `index.apply`."""
    wall = cpu = 0.0
    for _ in range(3):
        index = index_cls(max_blocks=num_blocks * 2)
        t0, c0 = time.perf_counter(), time.thread_time()
        for payload in payloads:
            index.apply("http://w0", NS, decode_batch(payload).events)
        c1, t1 = time.thread_time(), time.perf_counter()
        wall, cpu = max(wall, len(index) / (t1 - t0)), max(cpu, len(index) / (c1 - c0))
    return {"wall": wall, "cpu": cpu}


def match_ms(index_cls, size: int) -> float:
    rng = random.Random(size)
    tokens = [rng.randrange(32_000) for _ in range(size)]
    index = index_cls()
    index.apply("http://w0", NS, [chain(tokens, 1)])
    keys = block_keys(tokens, NS)
    reps = [f"http://w{i}" for i in range(4)]
    reads = getattr(index, "lookup", index)  # a baseline from before issue 37 reads on itself
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        reads.match(keys, reps)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", default="369fa11")
    ap.add_argument("--blocks", type=int, default=200_000)
    args = ap.parse_args()
    from gateway.index.block_index import BlockIndex

    rows = [("baseline " + args.baseline, load_baseline(args.baseline)), ("HEAD", BlockIndex)]
    events = workload(args.blocks)
    payloads = [encode_batch([ev], 0) for ev in events]
    print(
        "                   store blocks/s          decode+apply blocks/s\n"
        "index                wall       CPU            wall       CPU   B/block"
        "   match 8k ms   match 32k ms"
    )
    for name, cls in rows:
        ing = ingestion(cls, events, args.blocks)
        full = decode_and_apply(cls, payloads, args.blocks)
        m8, m32 = match_ms(cls, 8192), match_ms(cls, 32768)
        print(
            f"{name:<17}{ing['wall']:>10,.0f}{ing['cpu']:>10,.0f}"
            f"{full['wall']:>16,.0f}{full['cpu']:>10,.0f}"
            f"{ing['bytes_per_block']:>10.0f}{m8:>14.3f}{m32:>15.3f}"
        )


if __name__ == "__main__":
    main()
