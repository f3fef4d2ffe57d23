"""`python -m harness.fleet`: serve N simulated replicas until SIGINT/SIGTERM.

    python -m harness.fleet --replicas 64 --num-blocks 2000 --manifest fleet.json

Ports are picked free by the fleet itself (no race with another process): `--manifest` gets the
replica URLs as JSON once every replica listens (`urls`, and `workers`: the same comma-separated,
for a gateway's `--workers`), and a line on stdout says so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path

from harness.fleet.engine import Timing
from harness.fleet.fleet import Fleet, FleetConfig


def parser() -> argparse.ArgumentParser:
    t = Timing()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--num-blocks", type=int, required=True, help="KV blocks per replica")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--model", default="demo", help='a model directory, or "demo"')
    ap.add_argument("--served-model-name", default="demo")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill-s-per-token", type=float, default=t.prefill_s_per_token)
    ap.add_argument("--decode-s-per-step", type=float, default=t.decode_s_per_step)
    ap.add_argument("--step-s", type=float, default=t.step_s, help="the floor of a prefill")
    ap.add_argument("--events-buffer", type=int, default=10_000, help="replay batches kept")
    ap.add_argument("--manifest", type=Path, help="write the replica URLs here (JSON)")
    return ap


async def serve(config: FleetConfig, manifest: Path | None) -> None:
    t0 = time.perf_counter()
    async with Fleet(config) as fleet:
        urls = fleet.urls
        if manifest is not None:
            tmp = manifest.with_suffix(".tmp")
            doc = {"pid": os.getpid(), "urls": urls, "workers": ",".join(urls)}
            tmp.write_text(json.dumps(doc))
            tmp.replace(manifest)  # whole or absent: a reader never sees half of it
        print(
            f"fleet ready: {config.replicas} replicas x {config.num_blocks} blocks on "
            f"{config.host} in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def main() -> None:
    args = parser().parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    timing = Timing(args.prefill_s_per_token, args.decode_s_per_step, args.step_s)
    try:
        config = FleetConfig(
            replicas=args.replicas,
            num_blocks=args.num_blocks,
            timing=timing,
            host=args.host,
            model=args.model,
            served_model_name=args.served_model_name,
            block_size=args.block_size,
            events_buffer=args.events_buffer,
        )
    except ValueError as e:
        parser().error(str(e))
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(serve(config, args.manifest))


if __name__ == "__main__":
    main()
