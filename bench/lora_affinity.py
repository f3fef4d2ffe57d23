"""LoRA adapter affinity: adapter loads and hit rate of each routing policy, side by side.

One cluster per policy (so every run starts with empty adapter slots and cold caches): N `sim`
workers (the real scheduler, LoRA slots and prefix cache; a timing model instead of the forward
pass) each serving the same A adapters with `--max-loras` slots, and one gateway. The workload is
the shared-prefix chat workload with one tenant per adapter: each tenant's requests name its
adapter, and its users share its system prompt. Adapter loads are the workers' own count of
adapters copied into a slot (`kvgate_worker_lora_loads_total`); the hit rate is reported cached
over prompt tokens (`usage.prompt_tokens_details.cached_tokens`).

    python -m bench.lora_affinity                    # 4 workers, 8 adapters, 2 slots each
    python -m bench.lora_affinity --policies cache_aware,round_robin,least_loaded
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.lib.report import args_dict, col, columns, print_table, write_json
from bench.lib.runs import POLICY_HEADER, add_workload_args
from harness import worker_metrics as wm
from harness.cluster import Cluster, ClusterSpec
from harness.driver import Result, hit_rate, run_workload
from harness.prom import metric_total
from harness.workload import Workload, WorkloadSpec
from worker.demo.lora import write_demo_adapter

LOADS = "kvgate_worker_lora_loads_total"


@dataclass(slots=True)
class Row:
    run: int = col("run", 3)
    policy: str = col("policy", 13, left=True, sep=" ")
    requests: int = col("reqs", 6)
    failed: int = col("fail", 5)
    adapter_loads: int = col("adapter loads", 14)
    hit_rate: float = col("hit rate", 10, ".1%")
    requests_per_replica: list[int]
    seconds: float = col("s", 7, ".1f")


COLUMNS = columns(Row)


def write_adapters(root: Path, n: int) -> dict[str, Path]:
    """n adapters of the demo model (the sim engine reads and checks them, never runs them)."""
    return {f"adapter-{i}": write_demo_adapter(root / f"adapter-{i}", "alpha") for i in range(n)}


def cluster_spec(
    args: argparse.Namespace, adapters: dict[str, Path], name: str, policy: str
) -> ClusterSpec:
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    return ClusterSpec(
        workers=args.replicas,
        engine="sim",
        num_blocks=args.num_blocks,
        policy=policy,
        worker_args=(
            *("--max-loras", str(args.max_loras), "--lora-modules", modules),
            *("--sim-prefill-s-per-token", str(args.sim_prefill_s_per_token)),
            *("--sim-decode-s-per-step", str(args.sim_decode_s_per_step)),
        ),
        gateway_args=("--poll-interval", "0.2", *args.gateway_args.split()),
        log_dir=args.log_dir / name,
    )


def run_policy(
    run: int, policy: str, workload: Workload, adapters: dict[str, Path], args: argparse.Namespace
) -> Row:
    names = list(adapters)
    with Cluster(cluster_spec(args, adapters, f"{policy}-{run}", policy)) as c:
        before = wm.scrape_all(c.worker_urls)
        t0 = time.perf_counter()
        results: list[Result] = asyncio.run(
            run_workload(
                c.gateway_url,
                workload,
                concurrency=args.concurrency,
                headers={POLICY_HEADER: policy},
                model_for=lambda turn: names[turn.tenant],
            )
        )
        seconds = time.perf_counter() - t0
        loads = sum(metric_total(url, LOADS) for url in c.worker_urls)
        per_worker = wm.deltas(before, wm.scrape_all(c.worker_urls))
    return Row(
        run=run,
        policy=policy,
        requests=len(results),
        failed=sum(not r.ok for r in results),
        adapter_loads=round(loads),
        hit_rate=hit_rate(results),
        requests_per_replica=[round(w.requests) for w in per_worker.values()],
        seconds=round(seconds, 2),
    )


def compare(args: argparse.Namespace, policies: list[str]) -> list[Row]:
    spec = WorkloadSpec(
        tenants=args.adapters,
        users_per_tenant=args.users_per_tenant,
        turns=args.turns,
        system_words=args.system_words,
        image_prob=0.0,
        seed=args.seed,
    )
    workload = Workload(spec)
    adapters = write_adapters(args.log_dir / "adapters", args.adapters)
    rows = []
    for run in range(args.runs):  # policies side by side in each run: a fresh cluster each
        for policy in policies:
            rows.append(run_policy(run, policy, workload, adapters, args))
            print_table(rows[-1:], COLUMNS, header=len(rows) == 1)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", default="cache_aware,round_robin")
    ap.add_argument("--runs", type=int, default=1, help="repeat the comparison (timing varies)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=2, help="adapter slots per worker")
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per worker")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--gateway-args", default="", help="extra gateway flags, e.g. --lora-weight 32")
    ap.add_argument("--sim-prefill-s-per-token", type=float, default=2e-5)
    ap.add_argument("--sim-decode-s-per-step", type=float, default=0.002)
    add_workload_args(ap)
    ap.set_defaults(users_per_tenant=4, system_words=400)
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/lora_affinity"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/lora_affinity.json"))
    return ap


def main() -> None:
    args = parser().parse_args()
    rows = compare(args, [p for p in args.policies.split(",") if p])
    for run in range(args.runs):
        by = {r.policy: r for r in rows if r.run == run}
        ca, rr = by.get("cache_aware"), by.get("round_robin")
        if ca is not None and rr is not None and ca.adapter_loads and rr.hit_rate:
            print(
                f"run {run}: round_robin loads {rr.adapter_loads / ca.adapter_loads:.1f}x the "
                f"adapters cache_aware does; cache_aware hits {ca.hit_rate / rr.hit_rate:.2f}x"
            )
    write_json(args.out, {"args": args_dict(args), "results": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
