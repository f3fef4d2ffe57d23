"""Chat load through a gateway with every request accounted for: `ok` (200 with a complete
body, or a stream ending in [DONE] without an error event), `failed` (a clear error: an HTTP
error status with an OpenAI error body, or an in-band stream error followed by [DONE]) or `lost`
(no answer: a timeout, a dropped connection, a stream that stops without [DONE]).

The fault tests send a fixed count (`run_load`); `bench.soak` runs it for a fixed time."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

from harness.prom import metric_total
from harness.waits import wait_until

_WORDS = (
    "cache block prefix route model token replica gateway worker latency memory tenant answer "
    "policy system prompt scheduler batch decode prefill event index hash layer attention queue"
).split()


@dataclass(slots=True)
class Tally:
    ok: int = 0
    failed: int = 0
    lost: int = 0
    failed_reasons: dict[str, int] = field(default_factory=dict)
    lost_reasons: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)

    def fail(self, reason: str) -> None:
        self.failed += 1
        self.failed_reasons[reason] = self.failed_reasons.get(reason, 0) + 1

    def lose(self, reason: str) -> None:
        self.lost += 1
        self.lost_reasons[reason] = self.lost_reasons.get(reason, 0) + 1


def make_body(rng: random.Random, groups: int) -> dict:
    g = rng.randrange(groups)
    system = " ".join(_WORDS[(g * 7 + i) % len(_WORDS)] for i in range(120 + 10 * g))
    user = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 60)))
    return {
        "model": "demo",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": rng.randint(1, 24),
        "stream": False,
    }


async def one_request(client: httpx.AsyncClient, url: str, body: dict, tally: Tally) -> None:
    t0 = time.monotonic()
    try:
        if body["stream"]:
            await _stream(client, url, body, tally)
        else:
            r = await client.post(url, json=body)
            if r.status_code == 200 and r.json().get("choices"):
                tally.ok += 1
            elif r.status_code >= 400 and "error" in r.json():
                tally.fail(str(r.status_code))
            else:
                tally.lose(f"bad answer {r.status_code}")
    except httpx.TimeoutException:
        tally.lose("timeout")
    except (httpx.HTTPError, ValueError) as e:
        tally.lose(type(e).__name__)
    tally.latencies.append(time.monotonic() - t0)


async def _stream(client: httpx.AsyncClient, url: str, body: dict, tally: Tally) -> None:
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            tally.fail(str(r.status_code))
            return
        data = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
    if not data or data[-1] != "data: [DONE]":
        tally.lose("stream without [DONE]")
    elif any('"error"' in ln for ln in data[:-1]):
        tally.fail("stream error event")
    else:
        tally.ok += 1


async def run_load(
    gateway_url: str,
    n: int,
    *,
    concurrency: int,
    stream_fraction: float = 0.25,
    seed: int = 0,
    groups: int = 6,
    timeout: float = 30.0,
    headers: dict[str, str] | None = None,
    max_tokens: int | None = None,
) -> Tally:
    """Send n requests (a fixed count, for the fault tests) and account for every one.

    `max_tokens` fixes every request's length (default: 1 to 24, drawn per request)."""
    tally = Tally()
    url = f"{gateway_url}/v1/chat/completions"
    rng = random.Random(seed)
    bodies = []
    for _ in range(n):
        body = make_body(rng, groups)
        body["stream"] = rng.random() < stream_fraction
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        bodies.append(body)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:

        async def one(body: dict) -> None:
            async with sem:
                await one_request(client, url, body, tally)

        await asyncio.gather(*(one(b) for b in bodies))
    return tally


async def hold_one_per_worker(
    gateway_url: str, worker_urls: list[str], *, max_tokens: int = 300
) -> asyncio.Task[Tally]:
    """Start one long non-streamed request per worker; return once every worker is running one.

    Round robin places concurrent requests on distinct replicas, so a fault injected next is
    sure to catch one of them in flight on its victim (background load alone may leave the
    victim idle at that moment). With the sim's >= 10 ms decode steps, 300 tokens run for
    seconds. Nothing else may use round robin meanwhile.
    """
    held = asyncio.create_task(
        run_load(
            gateway_url,
            len(worker_urls),
            concurrency=len(worker_urls),
            stream_fraction=0.0,
            seed=7,
            max_tokens=max_tokens,
            headers={"x-kvgate-routing-policy": "round_robin"},
        )
    )

    def every_worker_running() -> bool:
        return all(metric_total(w, "vllm:num_requests_running") >= 1 for w in worker_urls)

    await asyncio.to_thread(wait_until, every_worker_running, 15, "a held request on every worker")
    return held
