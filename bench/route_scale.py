"""The gateway's per-request work against the number of replicas, in one process, CPU time.

N healthy replicas of one model (no worker behind them: nothing is sent), whose index holds the
system prompt of each of 1.5 N tenants on one replica each, as after serving them. Each request
(one user turn of a random tenant, ~2,600 prompt tokens) goes through the gateway's own path:
`ProxyRequest.route` (candidates), `decide` (admit, render + keys, match + rank, slot) and
`release`. Per N: CPU milliseconds per request for the whole of it and for the routing decision
(match + rank + slot), median of `--requests`.

    python -m bench.route_scale                                   # N = 32, 128, 512, 2048
    python -m bench.route_scale --baseline /tmp/kvgate-before     # and another checkout's gateway

With `--baseline DIR` (repeatable) the same measurement runs again in a process that imports
`gateway` (and `cachekey`) from DIR, and all are printed side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUN_FLAG = "--one-tree"  # internal: measure this process's `gateway`, print JSON


def _tree_names() -> tuple:
    """(Replica, ReplicaId, ProxyRequest) wherever the measured tree has them: a --baseline tree
    may be from before issue 37 (names under fleet/) or issue 31 (every module flat)."""
    try:
        from gateway.fleet.replica import Replica
        from gateway.routing.request import ProxyRequest

        try:
            from gateway.names import ReplicaId
        except ModuleNotFoundError:
            from gateway.fleet.names import ReplicaId  # type: ignore[no-redef]
    except ModuleNotFoundError:
        from gateway.index import ReplicaId  # type: ignore[no-redef]
        from gateway.replica import Replica  # type: ignore[no-redef]
        from gateway.request import ProxyRequest  # type: ignore[no-redef]
    return Replica, ReplicaId, ProxyRequest


def _fleet(state, n: int, ns) -> list:
    """`n` healthy replicas of the demo model in `state`, with no events."""
    from cachekey.documents import KVEventsEndpoint, WorkerInfo

    Replica, ReplicaId, _ = _tree_names()
    info = WorkerInfo(
        model="demo",
        block_size=16,
        hash_seed=ns.seed,
        instance_id="i",
        kv_events=KVEventsEndpoint(enabled=False),
        num_blocks=4096,
    )
    reps = []
    for i in range(n):
        rid = ReplicaId(f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000")
        rep = Replica(id=rid, url=rid, healthy=True, instance_id="i")
        rep.model, rep.namespace, rep.info = "demo", ns, info
        state.replicas.replicas[rid] = rep
        state.index.set_traits(rid, True, 4096)
        reps.append(rep)
    return reps


async def measure(n: int, requests: int, model_dir: str) -> dict:
    from cachekey.events import BlockStored
    from cachekey.keys import HashNamespace, block_keys
    from gateway.config import GatewayConfig
    from gateway.protocol import ChatCompletionRequest
    from gateway.state import GatewayState

    ProxyRequest = _tree_names()[2]
    from harness.workload import Workload, WorkloadSpec

    state = GatewayState.build(GatewayConfig(model_dir=model_dir, max_inflight_per_replica=None))
    ns = HashNamespace("demo", 16)
    reps = _fleet(state, n, ns)
    renderer = await state.get_renderer()
    workload = Workload(
        WorkloadSpec(tenants=max(1, n * 3 // 2), users_per_tenant=1, turns=1, image_prob=0.0)
    )
    for t in range(workload.spec.tenants):  # each tenant's system prompt cached on one replica
        prompt = renderer.render_chat(workload.initial_messages(t))
        keys = block_keys(prompt.token_ids, ns)
        tokens = list(prompt.token_ids[: len(keys) * 16])
        state.index.store(reps[t % n].id, ns, BlockStored(list(keys), None, tokens, 16))
    rng = random.Random(0)
    total, decision = [], []
    for i in range(requests + 10):
        t = rng.randrange(workload.spec.tenants)
        msgs = [*workload.initial_messages(t), {"role": "user", "content": f"question {i}"}]
        body = ChatCompletionRequest.model_validate({"model": "demo", "messages": msgs})
        c0 = time.process_time()
        px = ProxyRequest.route(state, "/v1/chat/completions", body, {})
        await px.admit()
        await px.render()
        c1 = time.process_time()
        await px.rank()
        c2 = time.process_time()
        px.release(
            "200", {"prompt_tokens_details": {"cached_tokens": getattr(px, "lease", px).predicted}}
        )
        c3 = time.process_time()
        if i >= 10:  # the first ones warm the render caches
            total.append(c3 - c0)
            decision.append(c2 - c1)
    await state.close()
    return {
        "replicas": n,
        "cpu_ms_per_request": 1e3 * statistics.median(total),
        "decision_cpu_ms": 1e3 * statistics.median(decision),
    }


def run_tree(src: Path | None, sizes: list[int], requests: int) -> list[dict]:
    """The measurement in a fresh process importing `gateway` from `src` (None: this tree)."""
    here = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), here] if src else [here]))
    cmd = [sys.executable, str(Path(__file__).resolve()), RUN_FLAG, ",".join(map(str, sizes))]
    out = subprocess.run(
        [*cmd, str(requests)], env=env, capture_output=True, text=True, check=False, cwd=src
    )
    if out.returncode != 0:
        raise RuntimeError(f"measuring {src or 'this tree'} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == RUN_FLAG:
        from worker.demo.model import ensure_demo_model

        sizes, requests = [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
        model = str(ensure_demo_model())
        print(json.dumps([asyncio.run(measure(n, requests, model)) for n in sizes]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", default="32,128,512,2048")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument(
        "--baseline",
        type=Path,
        action="append",
        default=[],
        help="a checkout whose gateway to measure alongside (repeatable)",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/route_scale.json"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.replicas.split(",")]
    trees: dict[str, Path | None] = {"this tree": None, **{b.name: b for b in args.baseline}}
    results = {name: run_tree(src, sizes, args.requests) for name, src in trees.items()}
    print(
        f"{'replicas':>8}" + "".join(f"{name + ' ms/req':>22}{'decision ms':>13}" for name in trees)
    )
    for i, n in enumerate(sizes):
        cells = "".join(
            f"{r[i]['cpu_ms_per_request']:>22.3f}{r[i]['decision_cpu_ms']:>13.3f}"
            for r in results.values()
        )
        print(f"{n:>8}{cells}")
    from bench.lib.report import args_dict, write_json

    write_json(args.out, {"args": args_dict(args), **results})


if __name__ == "__main__":
    main()
