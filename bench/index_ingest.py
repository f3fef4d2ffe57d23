"""Index ingestion and routing match, the BlockIndex of HEAD against a baseline, in one run.

The baseline is `gateway/index.py` at a git revision (default 369fa11, before the compact index),
loaded from `git show` into its own module, so both run on the same machine in the same process.
Ingestion: `BlockStored` events of 64 blocks with vLLM-style int hashes, re-hashed into gateway
keys (blocks/s), and the index's memory per block (tracemalloc). Match: one replica holds the
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

from cachekey.events import BlockStored
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


def ingestion(index_cls, num_blocks: int) -> dict:
    rng = random.Random(2)
    events = [
        chain([rng.randrange(32_000) for _ in range(1024)], g + 1) for g in range(num_blocks // 64)
    ]
    tracemalloc.start()
    index = index_cls(max_blocks=num_blocks * 2)
    t0 = time.perf_counter()
    for ev in events:
        index.store("http://w0", NS, ev)
    elapsed = time.perf_counter() - t0
    measured, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"blocks_per_s": len(index) / elapsed, "bytes_per_block": measured / len(index)}


def match_ms(index_cls, size: int) -> float:
    rng = random.Random(size)
    tokens = [rng.randrange(32_000) for _ in range(size)]
    index = index_cls()
    index.apply("http://w0", NS, [chain(tokens, 1)])
    keys = block_keys(tokens, NS)
    reps = [f"http://w{i}" for i in range(4)]
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        index.match(keys, reps)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", default="369fa11")
    ap.add_argument("--blocks", type=int, default=200_000)
    args = ap.parse_args()
    from gateway.index import BlockIndex

    rows = [("baseline " + args.baseline, load_baseline(args.baseline)), ("HEAD", BlockIndex)]
    print("index            blocks/s   B/block   match 8k ms   match 32k ms")
    for name, cls in rows:
        ing = ingestion(cls, args.blocks)
        m8, m32 = match_ms(cls, 8192), match_ms(cls, 32768)
        print(
            f"{name:<15}{ing['blocks_per_s']:>10,.0f}{ing['bytes_per_block']:>10.0f}{m8:>14.3f}{m32:>15.3f}"
        )


if __name__ == "__main__":
    main()
