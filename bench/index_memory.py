"""Memory of the gateway's block index per cached block, for sizing a gateway (docs/kubernetes.md).

Fills a `BlockIndex` with `--blocks` distinct blocks spread over `--replicas` replicas, as their
`BlockStored` events would (chains of 64 blocks; kvgate workers' 16-byte hashes, or vLLM's int
hashes), then has a second replica store every chain again (two copies of each block, as when
a prefix is cached on two replicas), then the first replica's host-memory tier (`medium: "CPU"`)
every chain too (a block in both tiers of one replica: one more bit, no engine hash more).
Reports the process's RSS growth (the figure to size a pod by: it includes the allocator's
overhead), the index's own estimate (`kvgate_index_bytes`) and the bytes per block for each
step.

    python -m bench.index_memory                      # 1M blocks over 512 replicas
    python -m bench.index_memory --blocks 2000000 --hashes int
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from pathlib import Path

from bench.lib.report import args_dict, write_json
from cachekey.events import BlockStored
from cachekey.keys import HashNamespace, block_keys
from gateway.index.block_index import BlockIndex
from gateway.names import ReplicaId

NS = HashNamespace("demo", 16)
CHAIN = 64  # blocks per BlockStored


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def fill(
    index: BlockIndex, blocks: int, replicas: int, hashes: str, shift: int, medium: str = "GPU"
) -> None:
    """Chains of CHAIN blocks, chain c on replica (c + shift) % replicas; the same chains (and
    engine hashes) whatever `shift`, so a second pass adds a copy of each block elsewhere, and
    a pass with `medium` "CPU" a copy in a replica's host tier."""
    for c in range(blocks // CHAIN):
        tokens = [(c * 7919 + i) % 50_000 for i in range(CHAIN * 16)]
        keys = block_keys(tokens, NS)
        engine = list(keys) if hashes == "bytes" else [c * CHAIN + i for i in range(CHAIN)]
        rid = ReplicaId(f"http://10.0.{(c + shift) % replicas // 256}.{(c + shift) % 256}:8000")
        index.store(rid, NS, BlockStored(engine, None, tokens, 16, medium=medium))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--replicas", type=int, default=512)
    ap.add_argument("--hashes", choices=("bytes", "int"), default="bytes")
    ap.add_argument("--out", type=Path, default=Path("bench/results/index_memory.json"))
    args = ap.parse_args()
    index = BlockIndex(max_blocks=2 * args.blocks)
    gc.collect()
    rows = []
    base = rss_bytes()
    steps = [("one copy", 0, "GPU"), ("two copies", 1, "GPU"), ("host tier too", 0, "CPU")]
    for step, shift, medium in steps:
        t0 = time.process_time()
        fill(index, args.blocks, args.replicas, args.hashes, shift, medium)
        cpu = time.process_time() - t0
        gc.collect()
        grown = rss_bytes() - base
        stats = index.stats()
        rows.append(
            {
                "step": step,
                "blocks": stats.blocks,
                "copies": stats.copies,
                "rss_mb": grown / 2**20,
                "rss_bytes_per_block": grown / stats.blocks,
                "estimate_bytes_per_block": stats.bytes / stats.blocks,
                "store_s_per_million": cpu / (args.blocks / 1e6),
            }
        )
        r = rows[-1]
        print(
            f"{step:>13}: {r['blocks']:,} blocks, {r['copies']:,} copies: RSS +{r['rss_mb']:.0f} MB"
            f" = {r['rss_bytes_per_block']:.0f} B/block (index estimate "
            f"{r['estimate_bytes_per_block']:.0f}); {r['store_s_per_million']:.1f} s CPU per "
            "million blocks stored",
            flush=True,
        )
    write_json(args.out, {"args": args_dict(args), "rows": rows})


if __name__ == "__main__":
    main()
