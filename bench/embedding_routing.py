"""Embedding requests through the gateway: cache-aware routing against round robin (4 workers).

The workload is shared-prefix documents: `--groups` long prefixes (a document, a system prompt),
each embedded `--per-group` times with a short suffix of its own, in a seeded shuffled order, as
`/v1/embeddings` requests with mean pooling (every prompt token's hidden state). One cluster of
`--workers` sim workers (`--hidden-state-cache`, `--num-blocks` each: about a third of the
prefixes fit in one worker) and one gateway serves the same trace once per policy, chosen per
request with the `x-kvgate-routing-policy` header, each run on cold caches.

Reported per policy: the token hit rate from the responses' `cached_tokens`, the share of requests
whose predicted cached tokens (`x-kvgate-predicted-cached-tokens`) equal the reported ones, the
workers' own hidden-state hit counters, and max/mean requests per worker.

    .venv/bin/python -m bench.embedding_routing          # bench/results/embedding_routing.json
    .venv/bin/python -m bench.embedding_routing --engine torch   # real forward passes (slower)
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.lib.report import args_dict, col, columns, print_table, write_json
from bench.lib.runs import POLICY_HEADER, reset_caches
from harness.cluster import Cluster, ClusterSpec
from harness.prom import metric_total

WORDS = (
    "cache block prefix route model token image worker gateway replica tenant layer attention "
    "query key value batch decode prefill event index hash vision tower scheduler memory budget"
).split()
HITS = "kvgate_worker_hidden_state_hits_total"
QUERIES = "kvgate_worker_hidden_state_queries_total"


@dataclass(slots=True)
class Row:
    policy: str = col("policy", 12, left=True)
    requests: int = col("reqs", 6)
    failed: int = col("fail", 5)
    hit_rate: float = col("hit rate", 10, ".1%")
    exact_predictions: float = col("exact pred", 12, ".1%")
    worker_hidden_hit_rate: float = col("worker hidden hit", 19, ".1%")
    max_over_mean: float = col("max/mean", 10, ".2f")


COLUMNS = columns(Row)


def make_trace(groups: int, per_group: int, prefix_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    prefixes = [f"Document {g}: " + words(prefix_words) for g in range(groups)]
    trace = [f"{p} Question {i}: {words(20)}" for p in prefixes for i in range(per_group)]
    rng.shuffle(trace)
    return trace


async def send_all(url: str, trace: list[str], policy: str, concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    headers = {POLICY_HEADER: policy}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(text: str) -> dict:
            async with sem:
                r = await client.post(
                    "/v1/embeddings",
                    json={"model": "demo", "input": text, "pooling": "mean"},
                    headers=headers,
                )
            if r.status_code != 200:
                return {"ok": False}
            usage = r.json()["usage"]
            return {
                "ok": True,
                "replica": r.headers["x-kvgate-replica"],
                "prompt": usage["prompt_tokens"],
                "cached": usage["prompt_tokens_details"]["cached_tokens"],
                "predicted": int(r.headers["x-kvgate-predicted-cached-tokens"]),
            }

        return await asyncio.gather(*(one(t) for t in trace))


def run_policy(cluster: Cluster, trace: list[str], policy: str, concurrency: int) -> Row:
    reset_caches(cluster.worker_urls)
    before = {w: (metric_total(w, HITS), metric_total(w, QUERIES)) for w in cluster.worker_urls}
    results = asyncio.run(send_all(cluster.gateway_url, trace, policy, concurrency))
    hits = sum(metric_total(w, HITS) - before[w][0] for w in cluster.worker_urls)
    queries = sum(metric_total(w, QUERIES) - before[w][1] for w in cluster.worker_urls)
    ok = [r for r in results if r["ok"]]
    # The header names a replica (its pod-style name), not its URL: count per name, idle ones as 0.
    per_name = Counter(r["replica"] for r in ok)
    counts = list(per_name.values()) + [0] * (len(cluster.worker_urls) - len(per_name))
    prompt = sum(r["prompt"] for r in ok)
    return Row(
        policy=policy,
        requests=len(results),
        failed=len(results) - len(ok),
        hit_rate=sum(r["cached"] for r in ok) / prompt if prompt else 0.0,
        exact_predictions=sum(r["cached"] == r["predicted"] for r in ok) / max(len(ok), 1),
        worker_hidden_hit_rate=hits / queries if queries else 0.0,
        max_over_mean=max(counts) / (sum(counts) / len(counts)) if sum(counts) else 0.0,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--engine", choices=("sim", "torch"), default="sim")
    ap.add_argument("--num-blocks", type=int, default=360, help="KV blocks per worker")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix-words", type=int, default=800)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--policies", default="cache_aware,round_robin")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/embedding_routing"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/embedding_routing.json"))
    args = ap.parse_args()
    trace = make_trace(args.groups, args.per_group, args.prefix_words, args.seed)
    spec = ClusterSpec(
        workers=args.workers,
        engine=args.engine,
        num_blocks=args.num_blocks,
        worker_args=("--hidden-state-cache",),
        gateway_args=("--poll-interval", "0.2"),
        log_dir=args.log_dir,
    )
    rows: list[Row] = []
    with Cluster(spec) as cluster:
        for policy in args.policies.split(","):
            rows.append(run_policy(cluster, trace, policy, args.concurrency))
            print_table(rows[-1:], COLUMNS, header=len(rows) == 1)
    hit = {r.policy: r.hit_rate for r in rows}
    summary = {}
    if hit.get("cache_aware") and hit.get("round_robin"):
        summary["cache_aware_over_round_robin"] = round(hit["cache_aware"] / hit["round_robin"], 2)
        print(f"cache_aware / round_robin hit rate: {summary['cache_aware_over_round_robin']}x")
    write_json(args.out, {"args": args_dict(args), "rows": [asdict(r) for r in rows], **summary})


if __name__ == "__main__":
    main()
