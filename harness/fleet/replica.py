"""One simulated replica as a gateway sees it: its HTTP endpoints, its engine, its events.

The endpoints are the kvgate worker's: `/health`, `/metrics` (vLLM's names), `/kvgate/info`,
`/kvgate/assets`, `/kv/snapshot`, `/v1/models`, `/v1/chat/completions`, `/v1/completions` and
`/reset_prefix_cache`. Every answer is built from this replica's own state.
"""

from __future__ import annotations

import itertools
import time
import uuid

import msgspec

from cachekey.documents import (
    KVEventsEndpoint,
    Snapshot,
    SnapshotBlock,
    WorkerInfo,
    encode_document,
)
from cachekey.events import topic
from cachekey.headers import PREFIX_HEADER
from cachekey.keys import parse_prefix_header
from cachekey.openai.sse import DONE
from harness.fleet.engine import Job, SimEngine, Timing
from harness.fleet.events import FleetZmq, ReplicaEvents
from harness.fleet.http_server import Exchange
from harness.fleet.model import FleetModel
from harness.fleet.openai_api import BadRequest, answer, chunk, parse_request, usage_chunk
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence

_json = msgspec.json.Encoder()
_ids = itertools.count()
_METRICS = "text/plain; version=0.0.4; charset=utf-8"
_HINT = PREFIX_HEADER.encode()


class SimReplica:
    def __init__(
        self,
        model: FleetModel,
        zmq_: FleetZmq,
        host: str,
        num_blocks: int,
        timing: Timing,
        events_buffer: int = 10_000,
    ) -> None:
        self.model = model
        self.instance_id = uuid.uuid4().hex
        self.events = ReplicaEvents(zmq_, host, topic(self.instance_id, model.name), events_buffer)
        try:
            self.engine = SimEngine(
                num_blocks, model.namespace.block_size, timing, self.events.publish
            )
        except BaseException:
            # Its sockets are the asyncio context's, which the fleet's close cannot reach: a
            # leaked one would block the context's term forever.
            self.events.close()
            raise
        self.port = 0  # set once its HTTP server listens
        self._info = b""
        self._routes = {
            ("GET", "/health"): lambda ex: ex.send(200, b""),
            ("GET", "/metrics"): lambda ex: ex.send(200, self.metrics_text(), _METRICS),
            ("GET", "/kvgate/info"): lambda ex: ex.send(200, self._info),
            ("GET", "/kvgate/assets"): lambda ex: ex.send(200, model.assets_doc),
            ("GET", "/kv/snapshot"): self._snapshot,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/chat/completions"): lambda ex: self._generate(ex, chat=True),
            ("POST", "/v1/completions"): lambda ex: self._generate(ex, chat=False),
            ("POST", "/reset_prefix_cache"): self._reset,
        }

    def listening(self, port: int) -> None:
        self.port = port
        self._info = encode_document(self.info())

    def info(self) -> WorkerInfo:
        m, ev = self.model, self.events
        return WorkerInfo(
            model=m.name,
            model_path=m.path,
            block_size=m.namespace.block_size,
            hash_seed=m.namespace.seed,
            fingerprint=m.fingerprint.digest(),
            fingerprint_parts=m.fingerprint,
            instance_id=self.instance_id,
            engine="sim",
            max_model_len=m.renderer.max_model_len,
            num_blocks=self.engine.bm.num_blocks,
            defers_shared_prefill=True,  # one prefill at a time: see harness/fleet/engine.py
            kv_events=KVEventsEndpoint(
                enabled=True,
                port=ev.port,
                replay_port=ev.replay_port,
                topic=ev.topic.decode(),
            ),
        )

    def handle(self, ex: Exchange) -> None:
        route = self._routes.get((ex.request.method, ex.request.path))
        if route is None:
            ex.error(404, f"Not Found: {ex.request.method} {ex.request.path}")
            return
        route(ex)

    # -- endpoints ---------------------------------------------------------------------------

    def _generate(self, ex: Exchange, chat: bool) -> None:
        hint = ex.request.headers.get(_HINT)
        if hint is not None:  # the gateway's predicted chain, kept from eviction (as the worker)
            key = parse_prefix_header(hint.decode("latin-1"))
            if key is not None:
                self.engine.bm.refresh_chain(key)
        try:
            req = parse_request(self.model, ex.request.body, chat)
        except BadRequest as e:
            ex.error(e.status, e.message, e.param)
            return
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(_ids)}"
        seq = Sequence(
            rid,
            req.prompt,
            SamplingParams(max_tokens=req.max_tokens),
            self.model.namespace,
            cache_salt=req.cache_salt,
        )
        if not self.engine.fits(seq, req.max_tokens):
            ex.error(400, "the prompt and max_tokens exceed this replica's KV cache", "max_tokens")
            return
        name = self.model.name

        def first_token(cached: int) -> None:
            if req.stream:
                ex.start()
                ex.chunk(chunk(rid, name, req, 1, finish=req.max_tokens == 1))

        def done() -> None:
            cached = job.cached_tokens
            if not req.stream:
                ex.send(200, answer(rid, name, req, cached))
                return
            if req.max_tokens > 1:
                ex.chunk(chunk(rid, name, req, req.max_tokens - 1, finish=True))
            if req.include_usage:
                ex.chunk(usage_chunk(rid, name, req, cached))
            ex.chunk(DONE)
            ex.end()

        job = Job(seq, req.max_tokens, first_token, done)
        self.engine.submit(job)

    def _snapshot(self, ex: Exchange) -> None:
        blocks = [
            SnapshotBlock(
                key=b.key.hex(),
                parent=b.parent.hex() if b.parent is not None else None,
                token_ids=list(b.token_ids),
                extra_keys=b.extra_keys,
            )
            for b in self.engine.bm.snapshot()
        ]
        doc = Snapshot(
            instance_id=self.instance_id,
            seq=self.events.last_seq,
            block_size=self.model.namespace.block_size,
            blocks=blocks,
        )
        ex.send(200, encode_document(doc))

    def _models(self, ex: Exchange) -> None:
        card = {
            "id": self.model.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "kvgate",
            "root": self.model.path,
            "parent": None,
            "max_model_len": self.model.renderer.max_model_len,
        }
        ex.send(200, _json.encode({"object": "list", "data": [card]}))

    def _reset(self, ex: Exchange) -> None:
        ex.send(200, _json.encode({"reset": self.engine.reset()}))

    def metrics_text(self) -> bytes:
        """The gauges and counters a gateway reads, with vLLM's names and labels."""
        e, c = self.engine, self.engine.counters
        labels = f'model_name="{self.model.name}",engine="0"'
        config = (
            f'block_size="{e.block_size}",num_gpu_blocks="{e.bm.num_blocks}",'
            'enable_prefix_caching="True",engine="0"'
        )
        families = (  # (name, type, ((sample suffix, value), ...))
            ("vllm:num_requests_running", "gauge", (("", e.running),)),
            ("vllm:num_requests_waiting", "gauge", (("", e.waiting),)),
            ("vllm:kv_cache_usage_perc", "gauge", (("", e.bm.usage()),)),
            ("vllm:prefix_cache_queries", "counter", (("_total", c.prompt_tokens),)),
            ("vllm:prefix_cache_hits", "counter", (("_total", c.cached_tokens),)),
            ("vllm:prompt_tokens", "counter", (("_total", c.prompt_tokens),)),
            ("vllm:generation_tokens", "counter", (("_total", c.generation_tokens),)),
            (
                "vllm:request_prefill_time_seconds",
                "summary",
                (("_sum", c.prefill_seconds), ("_count", c.requests)),
            ),
            (
                "vllm:request_prefill_kv_computed_tokens",
                "summary",
                (("_sum", c.computed_tokens), ("_count", c.requests)),
            ),
        )
        lines = []
        for name, kind, samples in families:
            lines.append(f"# TYPE {name} {kind}")
            lines += [f"{name}{suffix}{{{labels}}} {v}" for suffix, v in samples]
        lines += ["# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{config}}} 1.0"]
        return ("\n".join(lines) + "\n").encode()
