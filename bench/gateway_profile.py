"""Profile the gateway's request path through real HTTP: where its CPU time per request goes.

Zero-compute sim workers run as processes; the gateway runs in this process (uvicorn + uvloop,
as `python -m gateway` runs it) under cProfile with a CPU-time clock, so time spent waiting for
a core on a busy machine is not counted; a client process sends `--requests` chats at
`--concurrency`. Prints the functions by cumulative CPU time and writes the raw profile.

    python -m bench.gateway_profile --requests 1000      # -> bench/results/gateway.prof
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from pathlib import Path

import httpx
import uvicorn

from bench.lib.closed_loop import ZERO_COMPUTE
from gateway.app import create_app
from gateway.config import GatewayConfig
from harness.cluster import Cluster, ClusterSpec
from harness.ports import HOST, free_port

CLIENT = """
import sys
from bench.lib.closed_loop import measure
load = measure("gateway", [sys.argv[1]], int(sys.argv[2]), int(sys.argv[3]))
print(f"{load.requests} requests, {load.requests_per_s} req/s, p50 {load.p50_ms} ms")
"""


async def _profile(config: GatewayConfig, n: int, conc: int, prof: cProfile.Profile) -> None:
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config), host=HOST, port=config.port, log_level="warning", access_log=False
        )
    )
    task = asyncio.create_task(server.serve())
    url = f"http://{HOST}:{config.port}"
    async with httpx.AsyncClient() as h:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if (await h.get(f"{url}/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, url, str(n), str(conc)
    )
    prof.enable()
    await client.wait()
    prof.disable()
    server.should_exit = True
    await task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gateway.prof"))
    args = ap.parse_args()
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        worker_args=ZERO_COMPUTE,
        gateways=0,
        log_dir=Path("bench/results/logs/profile"),
    )
    prof = cProfile.Profile(time.thread_time)  # CPU time of the event loop's thread
    with Cluster(spec) as c:
        config = GatewayConfig(workers=tuple(c.worker_urls), port=free_port(), poll_interval=0.5)
        try:
            import uvloop

            uvloop.run(_profile(config, args.requests, args.concurrency, prof))
        except ImportError:
            asyncio.run(_profile(config, args.requests, args.concurrency, prof))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prof.dump_stats(args.out)
    pstats.Stats(str(args.out)).sort_stats("cumtime").print_stats(args.top)


if __name__ == "__main__":
    main()
