"""Exact against approximate, through one gateway and through three behind one address.

The `bench.under_load` workload and workers, cache_aware only, in four set-ups:

- exact: the index fed by the workers' KV events (plus speculative entries for what is in flight);
- approximate: `--no-kv-events`, the index holds only what the gateway routed (speculative
  entries that outlive their requests by `--speculative-ttl`, capped at each worker's cache size);
- 1 gateway, or 3 gateways behind a round-robin TCP front (`bench.lib.front`), each with its own
  index and load accounting: with events each still sees every worker's cache; without, each
  knows only the third of the traffic it routed.

Each set-up gets a fresh cluster (approximate indexes cannot hear a cache reset).

    python -m bench.index_modes                   # table + bench/results/index_modes.json
    python -m bench.index_modes --concurrency 16,64 --seed 0
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from bench.lib.front import RoundRobinFront
from bench.lib.load_runs import (
    COLUMNS,
    GATEWAY_ARGS,
    SEED,
    SIM_COST,
    LoadRow,
    blocks_per_worker,
    run_once,
    trace,
)
from bench.lib.report import args_dict, print_table, write_json
from harness.cluster import Cluster, ClusterSpec

SETUPS = (("exact", 1), ("approximate", 1), ("exact", 3), ("approximate", 3))


def run_setup(mode: str, gateways: int, conc: int, blocks: int, args) -> LoadRow:
    workload = trace(args.hot, args.seed)
    extra = ("--no-kv-events",) if mode == "approximate" else ()
    spec = ClusterSpec(
        workers=4,
        engine="sim",
        num_blocks=blocks,
        gateways=gateways,
        worker_args=SIM_COST,
        gateway_args=(*GATEWAY_ARGS, *extra),
        log_dir=args.log_dir / f"{mode}-g{gateways}-c{conc}",
    )
    label = f"{mode[:6]} x{gateways}"
    with Cluster(spec) as c:
        urls = [g.url for g in c.gateways]
        if gateways == 1:
            return run_once(urls[0], urls, c.worker_urls, workload, "cache_aware", conc, label)
        with RoundRobinFront(urls) as front:
            return run_once(front.url, urls, c.worker_urls, workload, "cache_aware", conc, label)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", default="16")
    ap.add_argument("--hot", action="store_true", help="the hot-tenant variant of the trace")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/index_modes"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/index_modes.json"))
    args = ap.parse_args()
    blocks = blocks_per_worker(trace(args.hot, args.seed))
    rows: list[LoadRow] = []
    for conc in (int(c) for c in args.concurrency.split(",")):
        for mode, gateways in SETUPS:
            rows.append(run_setup(mode, gateways, conc, blocks, args))
            print_table(rows[-1:], COLUMNS, header=len(rows) == 1)
    write_json(args.out, {"args": args_dict(args), "results": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
