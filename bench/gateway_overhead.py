"""What the gateway costs a request: added latency and routing decision time.

1. Added latency: p50/p99 of requests through the gateway vs straight to the workers, on sim
   workers with zero compute time, at 1 and 32 concurrent clients.
2. Routing decision: block keys + index match over 4 replicas + cache_aware ranking for
   1k/8k/32k-token prompts (in process; the prefix is indexed on one replica). Render time of a
   chat with a long shared system prompt, cold and warm (segment cache), for reference.
Index ingestion and memory have their own entry point, `python -m bench.index_ingest`.

    python -m bench.gateway_overhead            # tables + bench/results/gateway_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import httpx

from bench.lib.closed_loop import ZERO_COMPUTE
from bench.lib.report import percentile, write_json
from cachekey.events import BlockStored
from cachekey.keys import HashNamespace, block_keys
from gateway.config import GatewayConfig
from gateway.fleet.replica import Replica
from gateway.index.block_index import BlockIndex
from gateway.names import ReplicaId
from gateway.routing.policies import RouteContext
from gateway.routing.policies.cache_aware import CacheAwarePolicy
from harness.cluster import Cluster, ClusterSpec


async def _latencies(urls: list[str], n: int, concurrency: int) -> list[float]:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "a short question about caches " * 8}],
        "max_tokens": 1,
    }
    sem = asyncio.Semaphore(concurrency)
    out: list[float] = []
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                r = await client.post(f"{urls[i % len(urls)]}/v1/chat/completions", json=body)
                r.raise_for_status()
                out.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(i) for i in range(min(n, 32))))  # warm-up
        out.clear()
        await asyncio.gather(*(one(i) for i in range(n)))
    return out


def added_latency(n: int, workers: int) -> list[dict]:
    spec = ClusterSpec(
        workers=workers,
        engine="sim",
        worker_args=ZERO_COMPUTE,
        gateway_args=("--poll-interval", "0.5"),
        log_dir=Path("bench/results/logs/overhead"),
    )
    rows = []
    with Cluster(spec) as c:
        for conc in (1, 32):
            direct = asyncio.run(_latencies(c.worker_urls, n, conc))
            via = asyncio.run(_latencies([c.gateway_url], n, conc))
            row = {"concurrency": conc, "requests": n}
            for name, xs in (("direct", direct), ("gateway", via)):
                row[f"{name}_p50_ms"] = 1000 * statistics.median(xs)
                row[f"{name}_p99_ms"] = 1000 * percentile(xs, 0.99)
            row["added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
            row["added_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
            rows.append(row)
    return rows


def _stored_chain(tokens: list[int], bs: int, tag: int) -> BlockStored:
    n = len(tokens) // bs
    return BlockStored(
        block_hashes=[tag * 10_000_000 + i for i in range(n)],
        parent_block_hash=None,
        token_ids=tokens[: n * bs],
        block_size=bs,
    )


def routing_decision(sizes: tuple[int, ...], repeats: int) -> list[dict]:
    ns = HashNamespace("demo", 16)
    rng = random.Random(0)
    policy = CacheAwarePolicy(GatewayConfig())
    reps = [Replica(ReplicaId(f"http://w{i}"), f"http://w{i}", healthy=True) for i in range(4)]
    rows = []
    for size in sizes:
        tokens = [rng.randrange(32_000) for _ in range(size)]
        index = BlockIndex()
        index.apply(reps[0].id, ns, [_stored_chain(tokens, 16, 1)])
        keys_t, match_t = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            keys = block_keys(tokens, ns)
            t1 = time.perf_counter()
            matched = index.lookup.match(keys, [r.id for r in reps])
            ctx = RouteContext(reps, keys, size, 16, matched, {}, keys[0])
            ranked = policy.rank(ctx)
            t2 = time.perf_counter()
            assert ranked[0] is reps[0]
            keys_t.append(t1 - t0)
            match_t.append(t2 - t1)
        rows.append(
            {
                "prompt_tokens": size,
                "blocks": len(keys),
                "keys_ms_p50": 1000 * statistics.median(keys_t),
                "match_rank_ms_p50": 1000 * statistics.median(match_t),
                "total_ms_p50": 1000
                * statistics.median(a + b for a, b in zip(keys_t, match_t, strict=True)),
            }
        )
    return rows


def render_times(system_words: int) -> dict:
    from cachekey.assets import ModelAssets
    from cachekey.render import Renderer
    from worker.demo.model import ensure_demo_model

    renderer = Renderer(ModelAssets.from_dir(ensure_demo_model()))
    rng = random.Random(1)
    words = "cache block prefix route model token image request replica gateway".split()
    system = " ".join(rng.choice(words) for _ in range(system_words))
    times = []
    for i in range(20):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"q {i}"}]
        t0 = time.perf_counter()
        prompt = renderer.render_chat(msgs)
        times.append(time.perf_counter() - t0)
    return {
        "prompt_tokens": len(prompt),
        "cold_ms": 1000 * times[0],
        "warm_ms_p50": 1000 * statistics.median(times[1:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gateway_overhead.json"))
    args = ap.parse_args()
    result: dict = {}
    if not args.skip_latency:
        result["added_latency"] = added_latency(args.requests, args.workers)
        print("added latency (ms)      p50 direct  p50 gw  added   p99 direct  p99 gw  added")
        for r in result["added_latency"]:
            print(
                f"  concurrency {r['concurrency']:>3}      {r['direct_p50_ms']:>8.2f}"
                f"{r['gateway_p50_ms']:>8.2f}{r['added_p50_ms']:>7.2f}"
                f"{r['direct_p99_ms']:>13.2f}{r['gateway_p99_ms']:>8.2f}{r['added_p99_ms']:>7.2f}"
            )
    result["routing_decision"] = routing_decision((1024, 8192, 32768), repeats=30)
    print("routing decision (ms)   blocks   keys p50   match+rank p50   total p50")
    for r in result["routing_decision"]:
        print(
            f"  {r['prompt_tokens']:>6} tokens    {r['blocks']:>6}{r['keys_ms_p50']:>11.3f}"
            f"{r['match_rank_ms_p50']:>17.3f}{r['total_ms_p50']:>12.3f}"
        )
    result["render"] = render_times(3000)
    r = result["render"]
    print(
        f"render chat ({r['prompt_tokens']} tokens): cold {r['cold_ms']:.2f} ms, "
        f"warm p50 {r['warm_ms_p50']:.2f} ms"
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
