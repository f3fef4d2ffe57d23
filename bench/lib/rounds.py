"""Honest policy rounds: every worker (and the gateway) warmed with the workload's own shapes
before anything is measured, the policy order rotated each round (the first side of a round
pays whatever the host does then, each policy in its turn), and every round reported with the
medians over rounds."""

from __future__ import annotations

import asyncio
import copy
import statistics
from collections.abc import Sequence
from dataclasses import asdict, fields

from cachekey.headers import POLICY_HEADER
from harness.driver import run_workload
from harness.workload import Workload


def rotated(policies: Sequence[str], round_: int) -> list[str]:
    """Round k's order: the list turned by k places."""
    k = round_ % len(policies)
    return list(policies[k:]) + list(policies[:k])


def warm_up(
    gateway: str, urls: list[str], workload: Workload, concurrency: int, timeout: float = 600.0
) -> int:
    """Send each worker, directly and all at once, the workload's first `2 x concurrency`
    turns at its concurrency: every shape the measured runs take (long prompts, chunked prefill,
    decode batches at that size) has run on every worker before the first measured policy (on a
    GPU: the allocator's pools, autotuned kernels, CUDA graphs). Then the first
    `2 x workers x concurrency` turns through the gateway, round robin, so its latency models
    have timed every worker too, as a gateway that has been serving has. Returns the requests
    that failed (the caller resets the caches afterwards)."""
    head = copy.copy(workload)
    head.turns = workload.turns[: 2 * concurrency]
    through = copy.copy(workload)
    through.turns = workload.turns[: 2 * len(urls) * concurrency]
    robin = {POLICY_HEADER: "round_robin"}

    async def all_workers() -> list[list]:
        direct = await asyncio.gather(
            *(
                run_workload(u, head, concurrency=concurrency, stream=True, timeout=timeout)
                for u in urls
            )
        )
        kw = {"concurrency": concurrency, "stream": True, "timeout": timeout, "headers": robin}
        return [*direct, await run_workload(gateway, through, **kw)]

    return sum(not r.ok for results in asyncio.run(all_workers()) for r in results)


def medians(rows: list, key: str = "policy") -> list:
    """One row per policy: each numeric column's median over its rounds (round = -1)."""
    out = []
    for name in dict.fromkeys(getattr(r, key) for r in rows):
        mine = [r for r in rows if getattr(r, key) == name]
        values = asdict(mine[0])
        for f in fields(mine[0]):
            if f.name == "round":
                values[f.name] = -1
            elif isinstance(values[f.name], (int, float)):
                middle = statistics.median(getattr(r, f.name) for r in mine)
                values[f.name] = type(values[f.name])(middle)
            elif f.name in ("exact", "tier_exact"):  # 'a/b' counts: summed over the rounds
                values[f.name] = exact_sum([getattr(r, f.name) for r in mine])
        out.append(type(mine[0])(**values))
    return out


def exact_sum(parts: list[str]) -> str:
    """'a/b' strings summed: the predictions exact over all rounds."""
    num = sum(int(p.split("/")[0]) for p in parts)
    den = sum(int(p.split("/")[1]) for p in parts)
    return f"{num}/{den}"
