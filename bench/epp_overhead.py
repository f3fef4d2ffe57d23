"""What the EPP path adds to a request, next to what the HTTP gateway adds, in one run.

Two sim workers with zero compute time, one HTTP gateway and one EPP (`python -m gateway --epp`)
with the same flags, all real processes on 127.0.0.1. For each request, in turn:

- direct: POST straight to a worker;
- HTTP gateway: POST through the gateway; what it adds is `gateway - direct` (parse, render and
  keys, match, rank, and the proxy hop);
- EPP: the ext_proc exchange a proxy has before it forwards (headers, body, end of stream ->
  the endpoint header and the body sent back), timed at the client (bench/extproc_client.py,
  a Python gRPC client: its own thread hops count against the EPP).

The EPP's exchange replaces the HTTP gateway's added time in a Gateway API deployment (the
Gateway's own proxy hop is the same with or without kvgate), so the claim is
`EPP p50 <= HTTP gateway added p50`. Both processes also report their server-side render and
routing decision times (`kvgate_render_seconds`, `kvgate_routing_decision_seconds`): one code
path, so they should agree.

    python -m bench.epp_overhead            # table + bench/results/epp_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from bench.cluster import HOST, Cluster, ClusterSpec, Proc, free_port
from bench.extproc_client import ExtProcClient
from bench.report import percentile, write_json
from bench.throughput import ZERO_COMPUTE
from bench.workload import data_url, make_image

CHAT = "/v1/chat/completions"
GATEWAY_ARGS = ("--poll-interval", "0.5")


def bodies() -> dict[str, bytes]:
    text = {"role": "user", "content": "a short question about caches " * 8}
    image = {"role": "user", "content": [
        {"type": "text", "text": "what is in this picture? " * 4},
        {"type": "image_url", "image_url": {"url": data_url(make_image(11, 128))}},
    ]}  # fmt: skip
    return {
        name: json.dumps({"model": "demo", "messages": [m], "max_tokens": 1}).encode()
        for name, m in (("text chat", text), ("image chat", image))
    }


def start_epp(c: Cluster, log_dir: Path) -> tuple[Proc, int]:
    http, grpc_port = free_port(), free_port()
    args = ["-m", "gateway", "--workers", ",".join(c.worker_urls), "--host", HOST,
            "--port", str(http), "--epp", "--epp-port", str(grpc_port), *GATEWAY_ARGS]  # fmt: skip
    proc = Proc("epp", args, http, log_dir / "epp.log")
    proc.start()
    proc.wait_healthy(120)
    return proc, grpc_port


def server_means(url: str) -> dict[str, float]:
    """Mean render and routing decision time (ms) per request, from a process's /metrics."""
    samples: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name.endswith(("_seconds_sum", "_seconds_count")):
            samples[name] = samples.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    out = {}
    for metric in ("kvgate_render_seconds", "kvgate_routing_decision_seconds"):
        n = samples.get(f"{metric}_count", 0.0)
        out[metric] = 1000 * samples.get(f"{metric}_sum", 0.0) / n if n else 0.0
    return out


def measure(c: Cluster, epp_url: str, epp: ExtProcClient, body: bytes, n: int) -> dict:
    times: dict[str, list[float]] = {"direct": [], "gateway": [], "epp": []}
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as http:

        def direct(i: int) -> None:
            http.post(c.worker_urls[i % 2] + CHAT, content=body, headers=headers)

        def gateway(i: int) -> None:
            r = http.post(c.gateway_url + CHAT, content=body, headers=headers)
            assert r.status_code == 200, r.text

        def picker(i: int) -> None:
            call = epp.call()
            ans = call.request(CHAT, body)
            assert ans.immediate is None and ans.endpoints, ans
            call.close()

        steps = {"direct": direct, "gateway": gateway, "epp": picker}
        for i in range(n + 20):  # the first 20 of each warm up
            order = list(steps)[i % 3 :] + list(steps)[: i % 3]  # interleaved: no drift bias
            for name in order:
                t0 = time.perf_counter()
                steps[name](i)
                if i >= 20:
                    times[name].append(time.perf_counter() - t0)
    row: dict = {"requests": n}
    for name, xs in times.items():
        row[f"{name}_p50_ms"] = 1000 * statistics.median(xs)
        row[f"{name}_p99_ms"] = 1000 * percentile(xs, 0.99)
    row["http_added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
    row["http_added_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
    row["epp_over_http_added_p50"] = row["epp_p50_ms"] / row["http_added_p50_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path("bench/results/epp_overhead.json"))
    args = ap.parse_args()
    log_dir = Path("bench/results/logs/epp_overhead")
    spec = ClusterSpec(workers=2, engine="sim", worker_args=ZERO_COMPUTE,
                       gateway_args=GATEWAY_ARGS, log_dir=log_dir)  # fmt: skip
    result: dict = {"rows": {}}
    with Cluster(spec) as c:
        proc, grpc_port = start_epp(c, log_dir)
        try:
            time.sleep(2.0)  # both have polled the workers and loaded the render assets
            with ExtProcClient(f"{HOST}:{grpc_port}") as epp:
                for name, body in bodies().items():
                    result["rows"][name] = measure(c, proc.url, epp, body, args.requests)
            result["server_ms"] = {
                "http": server_means(c.gateway_url),
                "epp": server_means(proc.url),
            }
        finally:
            proc.kill()
    print("p50 / p99 ms      direct      HTTP gateway   HTTP added     EPP exchange   EPP/added")
    for name, r in result["rows"].items():
        print(
            f"  {name:<12}{r['direct_p50_ms']:>6.2f}/{r['direct_p99_ms']:<6.2f}"
            f"{r['gateway_p50_ms']:>7.2f}/{r['gateway_p99_ms']:<7.2f}"
            f"{r['http_added_p50_ms']:>6.2f}/{r['http_added_p99_ms']:<7.2f}"
            f"{r['epp_p50_ms']:>7.2f}/{r['epp_p99_ms']:<7.2f}{r['epp_over_http_added_p50']:>8.2f}"
        )
    for mode, m in result["server_ms"].items():
        print(
            f"server side, {mode:<5}: render + keys {m['kvgate_render_seconds']:.3f} ms, "
            f"routing decision {m['kvgate_routing_decision_seconds']:.3f} ms (means)"
        )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
