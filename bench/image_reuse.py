r"""Prefix hits that end inside an image: kvgate's engine with LMDeploy's clamp and with partial
reuse (vLLM's rule), side by side on one image-heavy trace.

Two torch workers on the CPU serve the same model, one with `--mm-match-rule clamp`, one with
`--mm-match-rule partial` (the default). Every turn of the trace goes to both at once, and the
next turn only when both have answered, so the two serve the same requests under the same load;
no gateway (the engine's rule is measured, not routing). The model is the demo LLaVA with a
28M-parameter random language model (`llava-cpu`, generated once under --models-dir), so that
prefill, not HTTP, is most of a request's TTFT; `--model demo` runs the demo model itself.

The trace is visual Q&A: each tenant's users ask about images, the image before the question,
drawn from a pool shared across tenants and from the tenant's own, so the same image comes back
behind the same system prompt with another question. Where the image's last token is not the
last of a block, that match ends inside the image: clamped, it is rewound to the block holding
the image's start and the image's tokens are prefilled again.

Reported per rule: the token hit rate from the responses (`cached_tokens`) and from the worker's
own prefix-cache counters (the run fails if they differ: what is reported is what was reused),
the prompt tokens computed, TTFT (streamed, to the first content chunk), the vision-tower runs,
and the TTFT of the requests whose hit differs between the rules; then partial against clamp.

    python -m bench.image_reuse                  # table + bench/results/image_reuse.json
    python -m bench.image_reuse --model demo --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.lib.report import args_dict, col, columns, percentile, print_table, write_json
from bench.lib.runs import add_workload_args, workload_spec
from harness import worker_metrics as wm
from harness.cluster import Cluster, ClusterSpec
from harness.driver import Result, hit_rate, run_side_by_side
from harness.prom import metric_total
from harness.random_llava import SHAPES, write_random_llava
from harness.workload import Workload, data_url, make_image

RULES = ("clamp", "partial")
TOWER_RUNS = "kvgate_worker_vision_tower_runs_total"
WARM_UP_IMAGE = 7_777_777  # a seed no trace image uses


@dataclass(slots=True)
class Row:
    rule: str = col("rule", 8, left=True)
    requests: int = col("reqs", 5)
    failed: int = col("fail", 5)
    hit_rate: float = col("hit", 7, ".1%")  # from the responses' cached_tokens
    worker_hit_rate: float = col("worker hit", 11, ".1%")  # the worker's prefix-cache counters
    computed_tokens: int = col("computed", 9)  # prompt tokens prefilled (not hit)
    ttft_p50_ms: float = col("TTFT p50", 10, ".1f", "ms")
    ttft_p90_ms: float = col("TTFT p90", 10, ".1f", "ms")
    tower_runs: int = col("tower runs", 11)
    # The requests whose hit differs between the rules (the same ones in both rows).
    differing: int = col("differ", 7)
    differing_ttft_p50_ms: float = col("their TTFT p50", 15, ".1f", "ms")
    prompt_tokens: int
    cached_tokens: int
    worker_hit_tokens: int


COLUMNS = columns(Row)


def ttft_p50_ms(results: list[Result]) -> float:
    ttfts = [r.ttft_s * 1000 for r in results if r.ok and r.ttft_s is not None]
    return round(percentile(ttfts, 0.5), 1)


def make_row(
    rule: str,
    results: list[Result],
    counters: wm.WorkerCounters,
    tower: int,
    differing: list[int],
) -> Row:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    queried = counters.queried_tokens
    return Row(
        rule=rule,
        requests=len(results),
        failed=len(results) - len(ok),
        hit_rate=hit_rate(results),
        worker_hit_rate=counters.hit_tokens / queried if queried else 0.0,
        computed_tokens=prompt - cached,
        ttft_p50_ms=round(percentile(ttfts, 0.5), 1),
        ttft_p90_ms=round(percentile(ttfts, 0.9), 1),
        tower_runs=tower,
        differing=len(differing),
        differing_ttft_p50_ms=ttft_p50_ms([results[i] for i in differing]),
        prompt_tokens=prompt,
        cached_tokens=cached,
        worker_hit_tokens=round(counters.hit_tokens),
    )


def warm_up(urls: list[str]) -> None:
    """One image request per worker, so first-call costs (allocator, kernels, the vision tower)
    are not measured; then empty prefix caches."""
    content = [
        {"type": "image_url", "image_url": {"url": data_url(make_image(WARM_UP_IMAGE))}},
        {"type": "text", "text": "warm up"},
    ]
    body = {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    for u in urls:
        httpx.post(f"{u}/v1/chat/completions", json=body, timeout=120).raise_for_status()
    wm.reset_prefix_caches(urls)


def run(args: argparse.Namespace) -> list[Row]:
    spec = workload_spec(
        args,
        args.tenants,
        user_words=args.user_words,
        image_prob=args.image_prob,
        shared_images=args.shared_images,
        images_per_tenant=args.images_per_tenant,
        max_tokens=args.max_tokens,
        image_first=True,
    )
    workload = Workload(spec)
    # One torch thread per worker: they share the cores, and OpenMP spin-waiting on a busy host
    # makes CPU timings swing wildly.
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    model = args.model
    if model in SHAPES:
        model = str(write_random_llava(args.models_dir / model, model))
    cluster = ClusterSpec(
        workers=len(RULES),
        engine="torch",
        model=model,
        num_blocks=args.num_blocks,
        worker_args=("--device", "cpu", "--dtype", "float32"),
        per_worker_args=[("--mm-match-rule", rule) for rule in RULES],
        gateways=0,
        log_dir=args.log_dir,
        startup_timeout=600.0,
    )
    with Cluster(cluster) as c:
        urls = c.worker_urls
        warm_up(urls)
        before = wm.scrape_all(urls)
        towers = [metric_total(u, TOWER_RUNS) for u in urls]
        print(f"{len(workload)} requests to each worker ({', '.join(RULES)}), in step...")
        t0 = time.perf_counter()
        results = asyncio.run(run_side_by_side(urls, workload, stream=True, timeout=600.0))
        print(f"done in {time.perf_counter() - t0:.1f} s")
        counters = wm.deltas(before, wm.scrape_all(urls))
        # run_side_by_side keeps the trace's order, so index i is one turn on both workers.
        pairs = zip(*(results[u] for u in urls), strict=True)
        differing = [i for i, (a, b) in enumerate(pairs) if a.cached_tokens != b.cached_tokens]
        rows = [
            make_row(
                rule, results[u], counters[u], round(metric_total(u, TOWER_RUNS) - t), differing
            )
            for rule, u, t in zip(RULES, urls, towers, strict=True)
        ]
    print_table(rows, COLUMNS)
    return rows


def compare(clamp: Row, partial: Row) -> dict[str, float]:
    """Partial reuse against the clamp, as ratios (hit-rate points as a difference)."""
    return {
        "hit_rate_points": round((partial.hit_rate - clamp.hit_rate) * 100, 1),
        "computed_tokens_ratio": round(partial.computed_tokens / clamp.computed_tokens, 3),
        "ttft_p50_ratio": round(partial.ttft_p50_ms / clamp.ttft_p50_ms, 3),
        "ttft_p90_ratio": round(partial.ttft_p90_ms / clamp.ttft_p90_ms, 3),
        "differing_ttft_p50_ratio": round(
            partial.differing_ttft_p50_ms / clamp.differing_ttft_p50_ms, 3
        )
        if clamp.differing_ttft_p50_ms
        else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--model",
        default="llava-cpu",
        help=f"a LLaVA directory, demo, or a generated shape ({', '.join(SHAPES)}: the demo "
        "with a language model big enough that prefill dominates TTFT on a CPU)",
    )
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/kvgate-bench-models"))
    ap.add_argument("--tenants", type=int, default=8)
    add_workload_args(ap)
    ap.set_defaults(users_per_tenant=6, turns=2, system_words=80)
    ap.add_argument("--user-words", type=int, default=12, help="words per question")
    ap.add_argument("--image-prob", type=float, default=0.9, help="share of turns with an image")
    ap.add_argument("--shared-images", type=int, default=2, help="images every tenant shows")
    ap.add_argument("--images-per-tenant", type=int, default=2, help="each tenant's own images")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per worker")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/image_reuse"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/image_reuse.json"))
    args = ap.parse_args()
    rows = run(args)
    clamp, partial = (next(r for r in rows if r.rule == rule) for rule in RULES)
    for row in rows:  # what the responses say was reused is what the worker counted
        if row.cached_tokens != row.worker_hit_tokens:
            raise SystemExit(
                f"{row.rule}: responses report {row.cached_tokens} cached tokens, the worker "
                f"counted {row.worker_hit_tokens} hits"
            )
    rel = compare(clamp, partial)
    print(
        f"partial vs clamp: hit rate {rel['hit_rate_points']:+.1f} points, prompt tokens computed "
        f"{rel['computed_tokens_ratio']:.3f}x, TTFT p50 {rel['ttft_p50_ratio']:.3f}x, "
        f"p90 {rel['ttft_p90_ratio']:.3f}x; on the {partial.differing} requests whose hit "
        f"differs, TTFT p50 {rel['differing_ttft_p50_ratio']:.3f}x"
    )
    summary = {
        "args": args_dict(args),
        "results": [asdict(r) for r in rows],
        "partial_vs_clamp": rel,
    }
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
