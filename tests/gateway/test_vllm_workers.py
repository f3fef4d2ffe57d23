"""Plain vLLM workers the way they are deployed: data-parallel ranks behind one URL, two servers on
one host, and connect mode (their publishers connect to the gateway's central SUB).

Each worker is `vllm_like.VllmLike`: real HTTP and real ZMQ sockets replaying frames recorded from
vLLM 0.33.0's own KV cache manager and publisher (tests/fixtures/vllm_0_33/), ports offset by the
rank as vLLM offsets them. The gateway side is the real `ReplicaSet` (polls, per-rank subscribers,
central SUB). After every step each replica's index must predict exactly what vLLM's own prefix
cache reported for the recorded probes.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from cachekey.assets import ModelAssets
from cachekey.events import decode_batch
from cachekey.keys import block_keys, usable_match
from cachekey.render import Renderer
from cachekey.types import MMItem
from gateway.config import GatewayConfig
from gateway.discovery.endpoints import parse_worker
from gateway.fleet.replica import Replica
from gateway.fleet.replica_set import ReplicaSet
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.names import ReplicaId, replica_name
from harness.ports import free_port, free_port_run
from harness.proc import Proc
from tests.support.metrics import sample
from tests.support.vllm_like import VllmLike, load
from tests.support.waits import until

WAIT_S = 15.0
DP = {r: load(f"data_parallel/rank{r}") for r in (0, 1)}


def predicted(index: BlockIndex, rep: Replica, probe: dict) -> int:
    """What the gateway predicts for a recorded probe on one replica: match, then its rule."""
    ns = rep.namespace
    assert ns is not None
    tokens = probe["tokens"]
    mm = tuple(MMItem(i, "image", off, n) for i, off, n in probe.get("mm", ()))
    keys = block_keys(tokens, ns, mm, probe.get("lora"), probe.get("salt"))
    n = index.lookup.match(keys, [rep.id], tokens=tokens, mm_items=mm)[rep.id]
    return usable_match(n * ns.block_size, len(tokens), ns.block_size, mm, rep.mm_match_rule)


def check_step(index: BlockIndex, rep: Replica, doc: dict, step: int) -> None:
    for probe in doc["steps"][step]["probes"]:
        got = predicted(index, rep, probe)
        assert got == probe["vllm_hit_tokens"], (rep.id, doc["steps"][step]["note"], probe)


class Gateway:
    """The gateway's replica set (real polls and subscribers) around one config."""

    def __init__(self, **config) -> None:
        self.config = GatewayConfig(poll_interval=0.1, event_tail_check_interval=0.2, **config)
        self.index, self.metrics = BlockIndex(), GatewayMetrics()

    async def __aenter__(self) -> Gateway:
        self.http = httpx.AsyncClient()
        self.set = ReplicaSet(self.config, self.index, self.metrics, self.http)
        await self.set.set_workers(frozenset(parse_worker(w) for w in self.config.workers))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.set.close()
        await self.http.aclose()

    def replica(self, rid: str) -> Replica | None:
        return self.set.replicas.get(ReplicaId(rid))

    async def synced(self, *rids: str) -> list[Replica]:
        def ready() -> bool:
            reps = [self.replica(r) for r in rids]
            return all(
                r is not None and r.link.subscriber and r.link.subscriber.synced.is_set()
                for r in reps
            )

        await until(ready, f"{rids} synced", WAIT_S)
        return [self.set.replicas[ReplicaId(r)] for r in rids]

    async def applied(self, rep: Replica, seq: int) -> None:
        await until(
            lambda: rep.link.subscriber is not None and rep.link.subscriber.last_seq == seq,
            f"{rep.id} seq {seq}",
            WAIT_S,
        )


def test_vllm_offsets_each_rank_and_stamps_it_into_its_batches():
    """The recorded DP fixture is vLLM's own: rank r's frames came from port + r, rank r inside."""
    for r, doc in DP.items():
        assert doc["vllm_version"] == "0.33.0" and doc["port_offset"] == r
        for step in doc["steps"]:
            assert decode_batch(bytes.fromhex(step["frames"][2])).data_parallel_rank == r


def test_a_live_batch_landing_while_the_tail_check_asks_the_replay_is_no_gap():
    """The tail check asks the replay port once the live stream has been idle. A batch published
    live while the replay answers is the live stream's own, not one it missed: no tail gap
    counted (this race once made the test below count 2 where 1 batch was lost)."""
    vllm = VllmLike(DP)

    def live_first(rank: int) -> None:
        if rank == 0 and vllm.published[0] == 1:  # rank 0's batch 1, live, before the answer
            vllm.publish(0)
            time.sleep(0.05)  # so that it lands before the replay answer does

    async def main() -> None:
        spec = f"{vllm.url};kv-events={vllm.events_port};kv-replay={vllm.replay_port}"
        async with Gateway(workers=(spec,)) as gw:
            rank0, _ = await gw.synced(vllm.url, f"{vllm.url}#dp1")
            vllm.subscribed(0)
            vllm.publish(0)
            await gw.applied(rank0, 0)
            vllm.before_replay = live_first
            await gw.applied(rank0, 1)
            check_step(gw.index, rank0, DP[0], 1)
            assert vllm.published[0] == 2  # the hook did publish it
            assert sample(gw.metrics, "kvgate_event_tail_gaps_total") == 0
            assert sample(gw.metrics, "kvgate_event_errors_total") == 0

    try:
        asyncio.run(main())
    finally:
        vllm.close()


def test_dp2_vllm_worker_is_one_replica_per_rank_indexed_apart():
    """Both ranks cache p; only rank 1 caches q; rank 0 evicts p. A merged index would say rank
    0 still holds p (or count it twice); per rank, each prediction is vLLM's own. Rank 1's
    last batch is lost on the wire: the tail check finds it on rank 1's offset replay port."""
    vllm = VllmLike(DP)
    vllm.waiting[1] = 3.0

    async def main() -> None:
        spec = f"{vllm.url};kv-events={vllm.events_port};kv-replay={vllm.replay_port}"
        async with Gateway(workers=(spec,)) as gw:
            rank0, rank1 = await gw.synced(vllm.url, f"{vllm.url}#dp1")
            assert (rank0.dp_rank, rank0.rank_header) == (0, 0)
            assert (rank1.dp_rank, rank1.rank_header) == (1, 1)
            assert rank1.link.pool is rank0.link.pool and rank0.info.max_model_len == 4096
            await until(lambda: rank1.waiting == 3.0, "rank 1's load from its engine label", WAIT_S)
            assert rank0.waiting == 0.0
            for r in (0, 1):
                vllm.subscribed(r)
                vllm.publish(r)
            await gw.applied(rank0, 0)
            await gw.applied(rank1, 0)
            check_step(gw.index, rank0, DP[0], 0)
            check_step(gw.index, rank1, DP[1], 0)
            vllm.publish(0)
            vllm.publish(1, deliver=False)  # lost live; nothing after it shows the gap
            await gw.applied(rank0, 1)
            await gw.applied(rank1, 1)
            check_step(gw.index, rank0, DP[0], 1)
            check_step(gw.index, rank1, DP[1], 1)
            assert sample(gw.metrics, "kvgate_event_tail_gaps_total") == 1
            assert sample(gw.metrics, "kvgate_event_errors_total") == 0

    try:
        asyncio.run(main())
    finally:
        vllm.close()


def test_a_batch_of_another_rank_is_never_merged():
    """Rank 1's batches arriving on rank 0's port (a misconfigured offset) are skipped and
    counted, and rank 0's index stays rank 0's."""
    vllm = VllmLike({0: DP[1]})  # serves rank 1's recorded frames as its only rank, 0

    async def main() -> None:
        spec = f"{vllm.url};kv-events={vllm.events_port};kv-replay={vllm.replay_port}"
        async with Gateway(workers=(spec,)) as gw:
            (rep,) = await gw.synced(vllm.url)
            vllm.subscribed(0)
            vllm.publish(0)
            await gw.applied(rep, 0)
            assert gw.index.lookup.replica_blocks(rep.id) == 0
            errors = gw.metrics.event_errors.labels("wrong_data_parallel_rank")
            assert errors._value.get() == 1

    try:
        asyncio.run(main())
    finally:
        vllm.close()


def test_two_vllm_workers_on_one_host_are_both_indexed():
    """Two servers on 127.0.0.1, each with its own events and replay ports (per-worker form of
    --workers), each replaying another recorded scenario."""
    a = VllmLike({0: load("incremental_int")}, topic="kv@a")
    b = VllmLike({0: load("extra_keys")}, topic="kv@b")

    async def main() -> None:
        specs = tuple(
            f"{w.url};kv-events={w.events_port};kv-replay={w.replay_port};kv-topic={t}"
            for w, t in ((a, "kv@a"), (b, "kv@b"))
        )
        async with Gateway(workers=specs) as gw:
            rep_a, rep_b = await gw.synced(a.url, b.url)
            a.subscribed(0)
            b.subscribed(0)
            b.publish(0)
            await gw.applied(rep_b, 0)
            check_step(gw.index, rep_b, b.docs[0], 0)
            for step in range(len(a.docs[0]["steps"])):
                a.publish(0)
                await gw.applied(rep_a, step)
                check_step(gw.index, rep_a, a.docs[0], step)
                check_step(gw.index, rep_b, b.docs[0], 0)  # b's index untouched by a's events

    try:
        asyncio.run(main())
    finally:
        a.close()
        b.close()


def test_connect_mode_one_central_sub_for_every_worker_and_rank():
    """The gateway binds one SUB (rank r's port + r); a DP-2 worker and a single-rank worker
    connect their PUBs to it, each with its own topic. Batches published before the gateway
    knew the worker, or lost before the SUB's subscription reached a new PUB (the connect-mode
    window recorded in connect_mode.json), come back from each worker's replay ROUTER."""
    base = free_port_run(2)
    bind = f"tcp://127.0.0.1:{base}"
    dp = VllmLike(DP, topic="kv@dp", connect_to=bind)
    one = VllmLike({0: load("connect_mode/connect_mode")}, topic="kv@one", connect_to=bind)
    stray = VllmLike({0: DP[0]}, topic="kv@nobody", connect_to=bind)

    async def main() -> None:
        specs = (
            f"{dp.url};kv-replay={dp.replay_port};kv-topic=kv@dp",
            f"{one.url};kv-replay={one.replay_port};kv-topic=kv@{{host}}-{{port}}",
        )
        one.topic = f"kv@127.0.0.1-{one.url.rsplit(':', 1)[1]}".encode()
        one.publish(0, deliver=False)  # before the gateway exists: only replay has it
        async with Gateway(workers=specs, kv_events_bind=bind) as gw:
            rank0, rank1, single = await gw.synced(dp.url, f"{dp.url}#dp1", one.url)
            assert single.link.subscriber.source.topic == one.topic.decode()
            await gw.applied(single, 0)  # rebuilt from the replay buffer at start
            check_step(gw.index, single, one.docs[0], 0)
            # Live batches until each PUB's subscription has arrived (the hub polls its SUB).
            for rep, worker, r in ((rank0, dp, 0), (rank1, dp, 1), (single, one, 0)):
                docs = worker.docs[r]
                for step in range(worker.published[r], len(docs["steps"])):
                    worker.publish(r)
                    await gw.applied(rep, step)
                    check_step(gw.index, rep, docs, step)
            unknown = gw.metrics.event_errors.labels("unknown_topic")
            deadline = time.monotonic() + 15
            while unknown._value.get() == 0:  # resent until the stray PUB's subscription is in
                assert time.monotonic() < deadline, "the stray topic was never counted"
                stray.pubs[0].send_multipart(stray.frames(0, 0))
                await asyncio.sleep(0.05)
            check_step(gw.index, rank0, DP[0], 1)  # the stray worker's rank-0 frames ignored

    try:
        asyncio.run(main())
    finally:
        for w in (dp, one, stray):
            w.close()


def test_connect_mode_refuses_two_workers_on_one_topic(caplog):
    """Connect mode tells workers apart by topic: a second worker on the same topic (and rank)
    gets no subscriber and one error line; the first keeps its index."""
    bind = f"tcp://127.0.0.1:{free_port_run(1)}"
    a = VllmLike({0: DP[0]}, topic="kv@same", connect_to=bind)
    b = VllmLike({0: DP[0]}, topic="kv@same", connect_to=bind)

    async def main() -> None:
        specs = tuple(f"{w.url};kv-replay={w.replay_port};kv-topic=kv@same" for w in (a, b))
        async with Gateway(workers=specs, kv_events_bind=bind) as gw:
            await until(
                lambda: all(gw.replica(w.url) and gw.replica(w.url).instance_id for w in (a, b)),
                "both polled",
                WAIT_S,
            )
            subs = [gw.replica(w.url).link.subscriber for w in (a, b)]
            assert sum(s is not None for s in subs) == 1

    try:
        asyncio.run(main())
    finally:
        a.close()
        b.close()
    assert "each needs its own topic" in caplog.text


def test_gateway_sends_each_request_to_the_rank_holding_its_prefix(tmp_path, demo_model_dir):
    """The whole gateway process: a prompt cached on rank 1 only is routed to rank 1 with
    `X-data-parallel-rank: 1` (vLLM's index of that engine); the replica id names the rank.
    A chat request without max_tokens gets what is left of vLLM's `max_model_len`."""
    vllm = VllmLike(DP, model="demo", max_model_len=40)
    port = free_port()
    spec = f"{vllm.url};kv-events={vllm.events_port};kv-replay={vllm.replay_port}"
    args = ["-m", "gateway", "--workers", spec, "--port", str(port)]
    args += ["--model-dir", str(demo_model_dir), "--poll-interval", "0.2"]
    gw = Proc("gateway", args, port, tmp_path / "gw.log")
    gw.start()
    try:
        gw.wait_healthy(60)
        rank1 = f"{vllm.url}#dp1"

        def index() -> dict:
            return httpx.get(f"{gw.url}/kvgate/index").json()["replicas"]

        deadline = time.monotonic() + 15
        while not all(index().get(r, {}).get("synced") for r in (vllm.url, rank1)):
            assert time.monotonic() < deadline, gw.log_tail()
            time.sleep(0.1)
        for r in (0, 1):
            vllm.subscribed(r)
            vllm.publish(r)
        vllm.publish(1)  # q on rank 1
        vllm.publish(0)  # rank 0 evicts p
        while index()[rank1]["seq"] != 1 or index()[vllm.url]["seq"] != 1:
            assert time.monotonic() < deadline, gw.log_tail()
            time.sleep(0.1)
        for tokens in ([*range(140, 148), 7], [*range(100, 108), 7]):  # q, then p
            body = {"model": "demo", "prompt": tokens, "max_tokens": 1}
            resp = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvgate-replica"] == replica_name(rank1, None)
            assert resp.headers["x-kvgate-predicted-cached-tokens"] == "8"
        assert vllm.rank_headers == ["1", "1"]
        assert vllm.prefix_headers == [None, None]  # predicted hits, but vLLM has no use for it
        chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
        resp = httpx.post(f"{gw.url}/v1/chat/completions", json=chat, timeout=30)
        assert resp.status_code == 200, resp.text
        prompt = Renderer(ModelAssets.from_dir(demo_model_dir)).render_chat(chat["messages"])
        assert vllm.bodies[-1]["max_tokens"] == 40 - len(prompt)  # not --max-output-tokens
    finally:
        gw.kill()
        vllm.close()


@pytest.mark.parametrize("name", ["lookahead", "hybrid_sliding_window"])
def test_gateway_predicts_what_vllm_hits_from_the_prompt_tokens(name, tmp_path, demo_model_dir):
    """The request path hands the index the prompt's tokens: a replica whose blocks are hashed
    with lookahead tokens (EAGLE/MTP), or a hybrid model's sliding-window group, is predicted
    exactly what vLLM's prefix cache hits (without the tokens: nothing, or too much)."""
    doc = load(name)
    vllm = VllmLike({0: doc})
    port = free_port()
    spec = f"{vllm.url};kv-events={vllm.events_port};kv-replay={vllm.replay_port}"
    args = ["-m", "gateway", "--workers", spec, "--port", str(port), "--speculative-ttl", "0"]
    args += ["--model-dir", str(demo_model_dir), "--poll-interval", "0.2"]
    gw = Proc("gateway", args, port, tmp_path / "gw.log")
    gw.start()
    try:
        gw.wait_healthy(60)

        def seq() -> int | None:
            return httpx.get(f"{gw.url}/kvgate/index").json()["replicas"][vllm.url]["seq"]

        deadline = time.monotonic() + 15
        while not httpx.get(f"{gw.url}/kvgate/index").json()["replicas"][vllm.url]["synced"]:
            assert time.monotonic() < deadline, gw.log_tail()
            time.sleep(0.1)
        vllm.subscribed(0)
        for i, step in enumerate(doc["steps"]):
            vllm.publish(0)
            while seq() != i:
                assert time.monotonic() < deadline, gw.log_tail()
                time.sleep(0.05)
            for probe in step["probes"]:
                body = {"model": "demo", "prompt": probe["tokens"], "max_tokens": 1}
                resp = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
                assert resp.status_code == 200, resp.text
                got = int(resp.headers["x-kvgate-predicted-cached-tokens"])
                assert got == probe["vllm_hit_tokens"], (step["note"], probe["tokens"])
    finally:
        gw.kill()
        vllm.close()


def test_a_worker_whose_events_arrive_only_by_replay_is_named(caplog):
    """Its `--workers` entry names an events port nothing publishes on (a vLLM `endpoint` with a
    non-wildcard host connects instead of binding, or a wrong port): every batch comes by the
    tail check's replay. After three such checks in a row the gateway names the worker and what
    to change; the index is still right, only late."""
    vllm = VllmLike({0: load("incremental_int")})
    silent = free_port_run(1)  # nothing binds it: the live SUB never gets a batch

    async def main() -> None:
        spec = f"{vllm.url};kv-events={silent};kv-replay={vllm.replay_port}"
        async with Gateway(workers=(spec,)) as gw:
            (rep,) = await gw.synced(vllm.url)
            for step in range(3):
                vllm.publish(0, deliver=False)
                await gw.applied(rep, step)
                check_step(gw.index, rep, vllm.docs[0], step)

    try:
        asyncio.run(main())
    finally:
        vllm.close()
    (warning,) = [r for r in caplog.records if "only through replay" in r.getMessage()]
    text = warning.getMessage()
    assert text.startswith(f"{vllm.url}: ") and f"tcp://127.0.0.1:{silent}" in text
    assert "--kv-events-bind" in text
