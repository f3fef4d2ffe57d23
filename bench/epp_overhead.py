"""What the EPP path adds to a request, next to what the HTTP gateway adds, in one run.

Two sim workers with zero compute time, one HTTP gateway and one EPP (`python -m gateway --epp`)
with the same flags behind a real Envoy (harness/envoy.py, the ORIGINAL_DST shape, full duplex,
response phase on), all real processes on 127.0.0.1. For each request, in turn:

- direct: POST straight to a worker;
- HTTP gateway: POST through the gateway; what it adds is `gateway - direct` (parse, render and
  keys, match, rank, and the proxy hop);
- Envoy + EPP: POST through Envoy, which asks the EPP; what it adds is `envoy_epp - direct`,
  and the acceptance is its ratio to what the HTTP gateway adds (at most 1.5);
- request phase only: the same EPP behind a second Envoy that sends it no response phase (no
  served endpoint, x-kvgate-* headers or usage): what the response phase costs;
- do-nothing EPP: Envoy in front of bench/lib/extproc_null.py, kvgate's ext_proc transport with
  no decision (a fixed endpoint, bodies echoed): what the protocol's round trips cost alone;
- plain Envoy: POST through Envoy alone (round robin, no ext_proc): the proxy hop without the EPP;
- baseline (`--baseline DIR`): Envoy + the EPP of another kvgate checkout (e.g. an older commit from
  `git archive`, run with this Python), side by side with this one;
- EPP: the ext_proc exchange a proxy has before it forwards (headers, body, end of stream ->
  the endpoint header and the body sent back), timed at a Python grpc.aio client;
- EPP floor: the same exchange for a request with no body to key (headers only, picked by
  load); `EPP - floor` is the EPP's decision (read, parse, render and keys, match, rank).

The machine's load moves the numbers: every "added" is the median of differences within a
round (the same moment's load), the rounds are interleaved (each starts at a different step),
and `--repeat` runs the whole measurement again to show the spread. The load average before and
after each repeat goes into the table and the JSON. Both processes also report their server-side
render and routing decision times (`kvgate_render_seconds`, `kvgate_routing_decision_seconds`),
and each Envoy its own clock per request (harness/envoy.py's access log): the request phase
(the client's first byte to the upstream's first: with ext_proc, the pick) and the response
phase (the upstream's last byte to the client's last).

    python -m bench.epp_overhead --repeat 5    # table + bench/results/epp_overhead.json
    mkdir /tmp/kvgate-old && git archive 0333703 | tar -x -C /tmp/kvgate-old
    python -m bench.epp_overhead --baseline /tmp/kvgate-old    # beside that commit's EPP
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench.lib.closed_loop import ZERO_COMPUTE
from bench.lib.report import args_dict, percentile, write_json
from harness.cluster import Cluster, ClusterSpec
from harness.envoy import Envoy
from harness.envoy_config import EnvoySpec
from harness.epp import EnvoyFront
from harness.extproc_client import exchange
from harness.ports import HOST, free_port
from harness.proc import Proc
from harness.prom import Scrape
from harness.workload import data_url, make_image

CHAT = "/v1/chat/completions"
GATEWAY_ARGS = ("--poll-interval", "0.5")
STEPS = (
    "direct",
    "gateway",
    "envoy_epp",
    "request_phase",
    "null_epp",
    "envoy",
    "epp",
    "epp_floor",
    "baseline",
)
# Differences within a round, then their median: (name, minuend, subtrahend).
ADDED = (
    ("http_added", "gateway", "direct"),
    ("envoy_epp_added", "envoy_epp", "direct"),
    ("request_phase_added", "request_phase", "direct"),
    ("null_epp_added", "null_epp", "direct"),
    ("envoy_added", "envoy", "direct"),
    ("epp_decision", "epp", "epp_floor"),
    ("baseline_added", "baseline", "direct"),
)


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


def server_means(url: str) -> dict[str, float]:
    """Mean render and routing decision time (ms) per request, from a process's /metrics."""
    page = Scrape.parse(httpx.get(f"{url}/metrics", timeout=10).text)
    out = {}
    for metric in ("kvgate_render_seconds", "kvgate_routing_decision_seconds"):
        n = page.total(f"{metric}_count")
        out[metric] = 1000 * page.total(f"{metric}_sum") / n if n else 0.0
    return out


async def measure(worker_urls: list[str], urls: dict[str, str], target: str, body: bytes,
                  n: int) -> dict:  # fmt: skip
    steps = tuple(s for s in STEPS if s != "baseline" or s in urls)
    times: dict[str, list[float]] = {name: [] for name in steps}
    headers = {"content-type": "application/json"}
    async with (
        httpx.AsyncClient(timeout=60) as http,
        grpc.aio.insecure_channel(target) as channel,
    ):
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def run(name: str, i: int) -> None:
            if name == "direct":
                url = worker_urls[i % len(worker_urls)]
                await http.post(url + CHAT, content=body, headers=headers)
            elif name in urls:
                r = await http.post(urls[name] + CHAT, content=body, headers=headers)
                assert r.status_code == 200, r.text
            else:  # the floor: a headers-only exchange, picked by load (no body, no render)
                await exchange(stub, body if name == "epp" else None)

        for i in range(n + 20):  # the first 20 rounds warm up
            k = i % len(steps)
            for name in steps[k:] + steps[:k]:  # interleaved: no drift bias
                t0 = time.perf_counter()
                await run(name, i)
                if i >= 20:
                    times[name].append(time.perf_counter() - t0)
    row: dict = {"requests": n}
    for name, xs in times.items():
        row[f"{name}_p50_ms"] = 1000 * statistics.median(xs)
        row[f"{name}_p99_ms"] = 1000 * percentile(xs, 0.99)
    for name, a, b in ADDED:
        if a not in times:
            continue
        diffs = [x - y for x, y in zip(times[a], times[b], strict=True)]
        row[f"{name}_p50_ms"] = 1000 * statistics.median(diffs)
    row["ratio"] = row["envoy_epp_added_p50_ms"] / row["http_added_p50_ms"]
    if "baseline_added_p50_ms" in row:
        row["baseline_ratio"] = row["baseline_added_p50_ms"] / row["http_added_p50_ms"]
    return row


HEAD = (
    "run  request     load | direct  HTTP added | Envoy+EPP added  ratio | request phase only"
    " | do-nothing EPP | plain Envoy | EPP decision"
)
BASELINE_HEAD = " | baseline added  ratio"


def show(run: str, name: str, load: str, r: dict) -> None:
    baseline = ""
    if "baseline_ratio" in r:
        baseline = f" |{r['baseline_added_p50_ms']:>15.2f}{r['baseline_ratio']:>6.2f}x"
    print(
        f"{run:<4} {name:<11}{load:>5} |{r['direct_p50_ms']:>7.2f}{r['http_added_p50_ms']:>12.2f}"
        f" |{r['envoy_epp_added_p50_ms']:>16.2f}{r['ratio']:>6.2f}x |"
        f"{r['request_phase_added_p50_ms']:>19.2f} |{r['null_epp_added_p50_ms']:>15.2f} |"
        f"{r['envoy_added_p50_ms']:>12.2f} |"
        f"{r['epp_decision_p50_ms']:>13.2f}{baseline}",
        flush=True,
    )


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per request kind, the median over the repeats of each "added", and the ratio's range."""
    out: dict[str, dict] = {}
    for name in runs[0]["rows"]:
        rows = [run["rows"][name] for run in runs]
        s = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_ms")}
        for key in ("ratio", "baseline_ratio"):
            if key in rows[0]:
                xs = [r[key] for r in rows]
                s |= {key: statistics.median(xs), f"{key}_min": min(xs), f"{key}_max": max(xs)}
        out[name] = s
    return out


@contextlib.contextmanager
def null_epp(worker_url: str, log_dir: Path) -> Iterator[str]:
    """bench/lib/extproc_null.py, naming `worker_url`'s endpoint: its gRPC address."""
    port = free_port()
    args = ["-m", "bench.lib.extproc_null", "--port", str(port),
            "--endpoint", worker_url.split("://", 1)[-1]]  # fmt: skip
    proc = Proc("extproc-null", args, port, log_dir / "extproc-null.log")
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection((HOST, port), 1):
                break
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the do-nothing EPP did not start:\n{proc.log_tail()}")
            time.sleep(0.1)
        yield f"{HOST}:{port}"
    finally:
        proc.kill()


def envoy_clock(envoys: dict[str, Envoy]) -> dict[str, dict[str, float]]:
    """Each Envoy's own medians over the run (ms): request phase and response phase."""
    out = {}
    for name, e in envoys.items():
        log = [x for x in e.access_log() if x["status"] == 200]
        out[name] = {
            phase: statistics.median(float(x[f"{phase}_us"]) for x in log) / 1000
            for phase in ("request", "response")
        }
    return out


def run_all(args: argparse.Namespace, c: Cluster, urls: dict[str, str], target: str) -> list:
    print(HEAD + (BASELINE_HEAD if "baseline" in urls else ""))
    runs = []
    for i in range(1, args.repeat + 1):
        run: dict = {"load_before": os.getloadavg()[0], "rows": {}}
        for name, body in bodies().items():
            row = asyncio.run(measure(c.worker_urls, urls, target, body, args.requests))
            run["rows"][name] = row
            show(str(i), name, f"{os.getloadavg()[0]:.1f}", row)
        run["load_after"] = os.getloadavg()[0]
        runs.append(run)
    return runs


def report(result: dict) -> None:
    runs = result["runs"]
    loads = [x for run in runs for x in (run["load_before"], run["load_after"])]
    print(f"median of {len(runs)} runs (load average {min(loads):.1f} to {max(loads):.1f}):")
    for name, s in result["summary"].items():
        show("all", name, "", s)
        print(f"{'':<23}ratio over the runs: {s['ratio_min']:.2f}x to {s['ratio_max']:.2f}x"
              + (f" (baseline {s['baseline_ratio_min']:.2f}x to {s['baseline_ratio_max']:.2f}x)"
                 if "baseline_ratio" in s else ""))  # fmt: skip
    print("(added, ratio and decision: medians of in-round differences with `direct`/`floor`)")
    for name, m in result["envoy_ms"].items():
        print(f"Envoy's clock, {name:<15}: request phase {m['request']:.3f} ms, "
              f"response phase {m['response']:.3f} ms (medians)")  # fmt: skip
    for mode, m in result["server_ms"].items():
        print(
            f"server side, {mode:<5}: render + keys {m['kvgate_render_seconds']:.3f} ms, "
            f"routing decision {m['kvgate_routing_decision_seconds']:.3f} ms (means)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="measured rounds per request kind")
    ap.add_argument("--repeat", type=int, default=3, help="whole measurements, one after another")
    ap.add_argument("--baseline", type=Path, help="another kvgate checkout whose EPP runs beside")
    ap.add_argument("--workers", type=int, default=2, help="sim workers (1: every path ends at "
                    "the same worker, so none gains from a warmer one)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("bench/results/epp_overhead.json"))
    args = ap.parse_args()
    log_dir = Path("bench/results/logs/epp_overhead")
    spec = ClusterSpec(workers=args.workers, engine="sim", worker_args=ZERO_COMPUTE,
                       gateway_args=GATEWAY_ARGS, log_dir=log_dir)  # fmt: skip
    result: dict = {"args": args_dict(args)}
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(Cluster(spec))
        front = stack.enter_context(EnvoyFront(c, log_dir, GATEWAY_ARGS))
        request_phase = stack.enter_context(
            Envoy(
                EnvoySpec(epp=front.target, response_phase=False, log_dir=log_dir),
                name="envoy-request-phase",
            )
        )
        plain = stack.enter_context(
            Envoy(
                EnvoySpec(epp="", workers=c.worker_urls, ext_proc=False, log_dir=log_dir),
                name="envoy-plain",
            )
        )
        null = stack.enter_context(null_epp(c.worker_urls[0], log_dir))
        nothing = stack.enter_context(Envoy(EnvoySpec(epp=null, log_dir=log_dir),
                                            name="envoy-do-nothing"))  # fmt: skip
        envoys = {"Envoy+EPP": front.envoy, "request phase": request_phase,
                  "do-nothing EPP": nothing, "plain Envoy": plain}  # fmt: skip
        urls = {"gateway": c.gateway_url, "envoy_epp": front.url, "request_phase":
                request_phase.url, "null_epp": nothing.url, "envoy": plain.url}  # fmt: skip
        if args.baseline is not None:
            # Its packages first, not this checkout's (which `-m` would put first, from the cwd).
            env = {"PYTHONPATH": str(args.baseline.resolve()), "PYTHONSAFEPATH": "1"}
            base = EnvoyFront(c, log_dir, GATEWAY_ARGS, name="baseline", epp_env=env)
            stack.enter_context(base)
            urls["baseline"], envoys["baseline"] = base.url, base.envoy
        time.sleep(2.0)  # both have polled the workers and loaded the render assets
        result["runs"] = run_all(args, c, urls, front.target)
        result["server_ms"] = {"http": server_means(c.gateway_url),
                               "epp": server_means(front.epp_url)}  # fmt: skip
        result["envoy_ms"] = envoy_clock(envoys)  # type: ignore[arg-type]
    result["summary"] = summarize(result["runs"])
    report(result)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
