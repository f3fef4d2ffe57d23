"""The multi-tenant chat trace of `bench.fleet_scale`, sized to the fleet, as requests to send.

`harness.workload` makes the conversations (tenants with long system prompts, users, turns, 30% of
turns with an image); here each turn becomes the body a client would send, its history holding
a fixed assistant reply (`CANNED_REPLY`), so that no request waits for another's text and the
whole trace is encoded once, before any clock starts. The working set is every distinct full
block of the trace, keyed as the gateway and the replicas key it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from cachekey.keys import block_keys
from harness.fleet.model import FleetModel
from harness.open_loop import TraceRequest
from harness.workload import Workload, WorkloadSpec

CANNED_REPLY = "sure, here is the answer you asked for"


@dataclass(frozen=True, slots=True)
class TraceShape:
    tenants_per_replica: float = 1.5
    users_per_tenant: int = 2
    turns: int = 3
    system_words: int = 1200
    max_tokens: int = 8
    seed: int = 1  # held out: the routing work was tuned on seed 0

    def spec(self, replicas: int) -> WorkloadSpec:
        return WorkloadSpec(
            tenants=max(1, round(self.tenants_per_replica * replicas)),
            users_per_tenant=self.users_per_tenant,
            turns=self.turns,
            system_words=self.system_words,
            max_tokens=self.max_tokens,
            seed=self.seed,
        )


@dataclass(slots=True)
class FleetTrace:
    requests: list[TraceRequest]
    tenants: int
    working_set: int  # distinct full blocks
    prompt_tokens: int  # summed over the requests

    def blocks_per_replica(self, replicas: int, cache_share: float) -> int:
        """Each replica's cache when the fleet's caches together hold `cache_share` times the
        working set."""
        return max(1, math.ceil(cache_share * self.working_set / replicas))


def build_trace(replicas: int, shape: TraceShape, model: FleetModel) -> FleetTrace:
    """The trace for a fleet of `replicas`, and its working set (rendered here: prints progress,
    it takes a few seconds per thousand requests)."""
    workload = Workload(shape.spec(replicas))
    histories: dict[str, list[dict]] = {}
    conversations: dict[str, int] = {}
    keys: set[bytes] = set()
    requests, tokens, t0 = [], 0, time.monotonic()
    for i, turn in enumerate(workload):
        msgs = histories.setdefault(turn.conversation, workload.initial_messages(turn.tenant))
        msgs.append({"role": "user", "content": turn.content})
        body = {"model": model.name, "messages": msgs, "max_tokens": shape.max_tokens}
        cid = conversations.setdefault(turn.conversation, len(conversations))
        requests.append(TraceRequest(cid, json.dumps(body).encode()))
        prompt = model.renderer.render_chat(msgs)
        keys.update(block_keys(prompt.token_ids, model.namespace, prompt.mm_items))
        tokens += len(prompt)
        msgs.append({"role": "assistant", "content": CANNED_REPLY})
        if (i + 1) % 2000 == 0:
            print(f"  trace: {i + 1}/{len(workload)} requests keyed", flush=True)
    print(
        f"trace for {replicas} replicas: {len(requests)} requests, {workload.spec.tenants} "
        f"tenants, {len(keys)} distinct blocks ({time.monotonic() - t0:.0f}s)",
        flush=True,
    )
    return FleetTrace(requests, workload.spec.tenants, len(keys), tokens)
