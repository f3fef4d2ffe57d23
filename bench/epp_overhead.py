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
- plain Envoy: POST through Envoy alone (round robin, no ext_proc): the proxy hop without the EPP;
- EPP: the ext_proc exchange a proxy has before it forwards (headers, body, end of stream ->
  the endpoint header and the body sent back), timed at a Python grpc.aio client;
- EPP floor: the same exchange for a request with no body to key (headers only, picked by
  load); `EPP - floor` is the EPP's decision (read, parse, render and keys, match, rank).

The machine's load moves the numbers: every "added" is the median of differences within a
round (the same moment's load), the rounds are interleaved (each starts at a different step),
and `--repeat` runs the whole measurement again to show the spread. The load average before and
after each repeat goes into the table and the JSON. Both processes also report their server-side
render and routing decision times (`kvgate_render_seconds`, `kvgate_routing_decision_seconds`).

    python -m bench.epp_overhead --repeat 5    # table + bench/results/epp_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench.lib.closed_loop import ZERO_COMPUTE
from bench.lib.report import args_dict, percentile, write_json
from harness.cluster import Cluster, ClusterSpec
from harness.envoy import Envoy, EnvoySpec
from harness.epp import EnvoyFront
from harness.extproc_client import header_map
from harness.workload import data_url, make_image

CHAT = "/v1/chat/completions"
GATEWAY_ARGS = ("--poll-interval", "0.5")
STEPS = ("direct", "gateway", "envoy_epp", "request_phase", "envoy", "epp", "epp_floor")
# Differences within a round, then their median: (name, minuend, subtrahend).
ADDED = (
    ("http_added", "gateway", "direct"),
    ("envoy_epp_added", "envoy_epp", "direct"),
    ("request_phase_added", "request_phase", "direct"),
    ("envoy_added", "envoy", "direct"),
    ("epp_decision", "epp", "epp_floor"),
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


async def exchange(stub: pb_grpc.ExternalProcessorStub, body: bytes | None) -> None:
    """One request's ext_proc exchange as a proxy has it before forwarding: headers, body and
    end of stream out; the endpoint (headers response) and the body back in; stream closed."""
    path, method = (CHAT, "POST") if body is not None else ("/v1/models", "GET")
    headers = pb.HttpHeaders(
        headers=header_map({":method": method, ":path": path}), end_of_stream=body is None
    )
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=headers))
    if body is not None:
        await call.write(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        )
    first = await call.read()
    assert first.HasField("request_headers"), first  # the pick, not a refusal
    more = body is not None
    while more:
        msg = await call.read()
        more = not msg.request_body.response.body_mutation.streamed_response.end_of_stream
    await call.done_writing()
    await call.read()  # the stream's end: the EPP releases the request


async def measure(worker_urls: list[str], urls: dict[str, str], target: str, body: bytes,
                  n: int) -> dict:  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in STEPS}
    headers = {"content-type": "application/json"}
    async with (
        httpx.AsyncClient(timeout=60) as http,
        grpc.aio.insecure_channel(target) as channel,
    ):
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def run(name: str, i: int) -> None:
            if name == "direct":
                await http.post(worker_urls[i % 2] + CHAT, content=body, headers=headers)
            elif name in urls:
                r = await http.post(urls[name] + CHAT, content=body, headers=headers)
                assert r.status_code == 200, r.text
            else:  # the floor: a headers-only exchange, picked by load (no body, no render)
                await exchange(stub, body if name == "epp" else None)

        for i in range(n + 20):  # the first 20 rounds warm up
            k = i % len(STEPS)
            for name in STEPS[k:] + STEPS[:k]:  # interleaved: no drift bias
                t0 = time.perf_counter()
                await run(name, i)
                if i >= 20:
                    times[name].append(time.perf_counter() - t0)
    row: dict = {"requests": n}
    for name, xs in times.items():
        row[f"{name}_p50_ms"] = 1000 * statistics.median(xs)
        row[f"{name}_p99_ms"] = 1000 * percentile(xs, 0.99)
    for name, a, b in ADDED:
        diffs = [x - y for x, y in zip(times[a], times[b], strict=True)]
        row[f"{name}_p50_ms"] = 1000 * statistics.median(diffs)
    row["ratio"] = row["envoy_epp_added_p50_ms"] / row["http_added_p50_ms"]
    return row


HEAD = (
    "run  request     load | direct  HTTP added | Envoy+EPP added  ratio | request phase only"
    " | plain Envoy | EPP decision"
)


def show(run: str, name: str, load: str, r: dict) -> None:
    print(
        f"{run:<4} {name:<11}{load:>5} |{r['direct_p50_ms']:>7.2f}{r['http_added_p50_ms']:>12.2f}"
        f" |{r['envoy_epp_added_p50_ms']:>16.2f}{r['ratio']:>6.2f}x |"
        f"{r['request_phase_added_p50_ms']:>19.2f} |{r['envoy_added_p50_ms']:>12.2f} |"
        f"{r['epp_decision_p50_ms']:>13.2f}",
        flush=True,
    )


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per request kind, the median over the repeats of each "added", and the ratio's range."""
    out: dict[str, dict] = {}
    for name in runs[0]["rows"]:
        rows = [run["rows"][name] for run in runs]
        s = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_ms")}
        ratios = [r["ratio"] for r in rows]
        s |= {"ratio": statistics.median(ratios), "ratio_min": min(ratios),
              "ratio_max": max(ratios)}  # fmt: skip
        out[name] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="measured rounds per request kind")
    ap.add_argument("--repeat", type=int, default=3, help="whole measurements, one after another")
    ap.add_argument("--out", type=Path, default=Path("bench/results/epp_overhead.json"))
    args = ap.parse_args()
    log_dir = Path("bench/results/logs/epp_overhead")
    spec = ClusterSpec(workers=2, engine="sim", worker_args=ZERO_COMPUTE,
                       gateway_args=GATEWAY_ARGS, log_dir=log_dir)  # fmt: skip
    result: dict = {"args": args_dict(args), "runs": []}
    with (
        Cluster(spec) as c,
        EnvoyFront(c, log_dir, GATEWAY_ARGS) as front,
        Envoy(EnvoySpec(epp=front.target, response_phase=False, log_dir=log_dir),
              name="envoy-request-phase") as request_phase,
        Envoy(EnvoySpec(epp="", workers=c.worker_urls, ext_proc=False, log_dir=log_dir),
              name="envoy-plain") as plain,
    ):  # fmt: skip
        urls = {"gateway": c.gateway_url, "envoy_epp": front.url,
                "request_phase": request_phase.url, "envoy": plain.url}  # fmt: skip
        time.sleep(2.0)  # both have polled the workers and loaded the render assets
        print(HEAD)
        for i in range(1, args.repeat + 1):
            run: dict = {"load_before": os.getloadavg()[0], "rows": {}}
            for name, body in bodies().items():
                row = asyncio.run(measure(c.worker_urls, urls, front.target, body, args.requests))
                run["rows"][name] = row
                show(str(i), name, f"{os.getloadavg()[0]:.1f}", row)
            run["load_after"] = os.getloadavg()[0]
            result["runs"].append(run)
        result["server_ms"] = {"http": server_means(c.gateway_url),
                               "epp": server_means(front.epp_url)}  # fmt: skip
    result["summary"] = summarize(result["runs"])
    loads = [x for run in result["runs"] for x in (run["load_before"], run["load_after"])]
    print(f"median of {args.repeat} runs (load average {min(loads):.1f} to {max(loads):.1f}):")
    for name, s in result["summary"].items():
        show("all", name, "", s)
        print(f"{'':<23}ratio over the runs: {s['ratio_min']:.2f}x to {s['ratio_max']:.2f}x")
    print("(added, ratio and decision: medians of in-round differences with `direct`/`floor`)")
    for mode, m in result["server_ms"].items():
        print(
            f"server side, {mode:<5}: render + keys {m['kvgate_render_seconds']:.3f} ms, "
            f"routing decision {m['kvgate_routing_decision_seconds']:.3f} ms (means)"
        )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
