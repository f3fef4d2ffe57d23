"""ProxyRequest: one request's routing decision, from admission to release.

It owns the parsed request (the one source of truth: the forwarded body is derived from it once,
in `payload`), its rendering and block keys, and the ranked replicas: `decide` picks one and
takes the request's `Lease` there (lease.py: the slot and the load charged to that replica),
which the retry path and the EPP then move or drop themselves. `release` records the outcome
and ends the lease, once.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import xxhash

from cachekey.errors import RenderError
from cachekey.keys import HashNamespace, usable_match
from cachekey.openai.errors import APIError
from cachekey.openai.protocol import OpenAIRequest
from cachekey.render import ImageOptions, Renderer
from cachekey.types import BlockKey, Prompt
from gateway import accounting
from gateway.fleet.replica import Replica
from gateway.images.fetch import image_options
from gateway.images.parts import pin_images
from gateway.limits import default_max_tokens, render_refusal
from gateway.names import ReplicaId
from gateway.protocol import ChatCompletionRequest
from gateway.routing.candidates import routable
from gateway.routing.lease import Lease
from gateway.routing.policies import Policy, RouteContext
from gateway.routing.policy_choice import choose_policy
from gateway.routing.render import is_small_text, render_request
from gateway.routing.services import RouteServices


@dataclass(slots=True, eq=False)
class ProxyRequest:
    state: RouteServices
    endpoint: str
    body: OpenAIRequest
    headers: Mapping[str, str]
    policy_name: str
    policy: Policy
    candidates: list[Replica]
    ns: HashNamespace
    tenant: str | None = None  # None: the gateway has no API keys
    wants_usage: bool = False  # the client asked for the usage chunk of a stream
    lora_name: str | None = None  # the LoRA adapter `model` names (None: a base model)
    admitted: bool = False
    prompt: Prompt = field(default_factory=lambda: Prompt([]))
    keys: list[BlockKey] = field(default_factory=list)
    matched: dict[ReplicaId, int] = field(default_factory=dict)  # prefix blocks, both tiers
    gpu: dict[ReplicaId, int] = field(default_factory=dict)  # of those, the GPU's (host tiers)
    ranked: list[Replica] = field(default_factory=list)
    lease: Lease = field(init=False)  # its slot and load on the replica it was sent to
    released: bool = False

    def __post_init__(self) -> None:
        st = self.state
        self.lease = Lease(st.admission, st.index, st.config, st.metrics, peers=st.peers)

    @classmethod
    def route(
        cls,
        state: RouteServices,
        endpoint: str,
        body: OpenAIRequest,
        headers: Mapping[str, str],
        tenant: str | None = None,
        subset: Collection[ReplicaId] | None = None,
    ) -> ProxyRequest:
        """The policy and the candidate replicas of a parsed request (404/503 when none).

        `subset`, when given, is the only replicas the request may go to (an EPP's proxy can
        name them); none of them available is a 503.
        """
        name, policy = choose_policy(state, headers)
        candidates, lora_name, ns = routable(state, body.model, subset)
        wants_usage = bool((body.stream_options or {}).get("include_usage"))
        return cls(
            state,
            endpoint,
            body,
            headers,
            name,
            policy,
            candidates,
            ns,
            tenant,
            wants_usage,
            lora_name,
        )

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens the replica will prefill or find cached (every input's, for embeddings)."""
        return len(self.prompt)

    # -- the stages, in order ----------------------------------------------------------------

    async def decide(self) -> Replica:
        """admit -> render + keys -> rank: the routing decision, shared by the HTTP proxy and
        the EPP. The chosen replica holds the lease; `ranked` is set."""
        await self.admit()
        try:
            await self.render()
        except RenderError as e:  # the one place a render refusal becomes the client's error
            raise render_refusal(e) from e
        await self.rank()
        assert self.lease.replica is not None
        return self.lease.replica

    async def admit(self) -> None:
        await self.state.admission.admit(self.candidates)
        self.admitted = True

    async def render_inputs(self) -> tuple[Renderer, ImageOptions]:
        """The renderer (a 503 when its assets cannot be loaded) and the request's image options:
        one time and byte budget for all its remote images (docs/security.md)."""
        st = self.state
        try:
            renderer = await st.get_renderer()
        except RuntimeError as e:
            raise APIError(503, str(e), code="assets_unavailable") from e
        return renderer, image_options(st.fetcher, st.config.allow_image_uuids, self.tenant)

    async def render(self) -> None:
        st = self.state
        t0 = time.perf_counter()
        renderer, images = await self.render_inputs()
        if is_small_text(self.body):
            self.prompt, self.keys = render_request(
                renderer, self.body, self.ns, images, self.lora_name
            )
        else:
            self.prompt, self.keys = await st.render_queue.run(
                render_request, renderer, self.body, self.ns, images, self.lora_name
            )
        st.metrics.render_seconds.observe(time.perf_counter() - t0)
        self._default_max_tokens(renderer.assets.max_model_len)

    def _default_max_tokens(self, model_len: int) -> None:
        """A chat request that names no output length gets --max-output-tokens (bounded by the
        smallest context of its candidates); a completion keeps OpenAI's default of 16."""
        b = self.body
        if not isinstance(b, ChatCompletionRequest):
            return
        lens = [r.info.max_model_len if r.info else None for r in self.candidates]
        context_len = min(n or model_len for n in lens)
        limits = self.state.config.limits
        n = default_max_tokens(b.requested_max_tokens(), len(self.prompt), context_len, limits)
        if n is not None:
            b.max_tokens = n

    async def rank(self) -> None:
        """Rank the candidates and take a slot on the best one with room."""
        st = self.state
        t0 = time.perf_counter()
        bs = self.ns.block_size
        keys = self.keys
        prompt = self.prompt  # its tokens: lookahead (EAGLE/MTP) and sliding-window replicas
        # Only replicas holding a prefix: those holding none cost nothing
        # (gateway/index/lookup.py, `hits`).
        gpu = None if st.config.ignore_host_tier else self.gpu
        hits = st.index.lookup.hits(
            keys, tokens=prompt.token_ids, mm_items=prompt.mm_items, gpu=gpu
        )
        if hits:
            allowed = {r.id for r in self.candidates if r.parity_ok}
            hits = {rid: n for rid, n in hits.items() if rid in allowed}
        self.matched = hits
        seed = (
            keys[0] if keys else xxhash.xxh3_128_digest(repr(self.prompt.token_ids[:bs]).encode())
        )
        ctx = RouteContext(
            self.candidates,
            keys,
            self.num_prompt_tokens,
            bs,
            self.matched,
            self.headers,
            seed,
            self.lora_name,
            {rid: n - self.gpu[rid] for rid, n in hits.items() if self.gpu.get(rid, n) < n},
            st.index.lookup.replica_blocks,
            None if st.config.ignore_host_tier else st.index.lookup.replica_host_blocks,
        )
        ranked = self.policy.rank(ctx)
        st.metrics.routing_seconds.observe(time.perf_counter() - t0)
        self.admitted = False  # place() turns the claim into a slot, or gives it up
        rep = await st.admission.place(ranked)
        self.ranked = [rep, *(r for r in ranked if r is not rep)]
        lease = self.lease
        lease.take(
            rep,
            self.prediction(rep),
            self.num_prompt_tokens,
            self.speculative_keys(),
            self.lora_name,
        )
        self._count_spill(rep, lease.predicted)

    def _count_spill(self, rep: Replica, predicted: int) -> None:
        """A spill: a longer prefix was held elsewhere, and the request recomputes it here."""
        longest = max(self.matched, key=self.matched.__getitem__, default=None)
        if longest is None or self.matched[longest] <= self.matched.get(rep.id, 0):
            return
        held = next((r for r in self.candidates if r.id == longest), None)
        lost = self.predicted_for(held) - predicted if held is not None else 0
        if lost > 0:
            m = self.state.metrics
            m.child(m.spills, self.policy_name).inc()
            m.child(m.spill_tokens, self.policy_name).inc(lost)

    def payload(self, *, usage_chunk: bool = True) -> bytes:
        """The body to forward, derived once from the parsed request.

        `usage_chunk` asks a stream for its usage chunk, which the HTTP relay hides again
        unless the client asked for it; the EPP, which does not relay, forwards the client's
        own stream options.
        """
        b = self.body
        if isinstance(b, ChatCompletionRequest):
            pin_images(b.messages, self.prompt)
        if b.stream and usage_chunk:
            b.stream_options = {**(b.stream_options or {}), "include_usage": True}
        return b.model_dump_json(exclude_unset=True).encode()

    def release(self, status: str, usage: dict | None = None) -> None:
        """The one place the request's outcome is recorded and its lease ended (or, before it
        was placed, its admission claim withdrawn)."""
        if self.released:
            return
        self.released = True
        st, lease = self.state, self.lease
        rep = lease.replica
        if rep is None:
            if self.admitted:
                st.admission.withdraw()
            accounting.answered_here(st, self.policy_name, status)
            return
        lease.end(refused=status.startswith("4"))
        accounting.finished(
            st,
            rep,
            self.policy_name,
            status,
            self.num_prompt_tokens,
            (lease.predicted, lease.predicted_host),
            usage,
        )

    # -- what the lease charges ----------------------------------------------------------------

    def predicted_for(self, rep: Replica) -> int:
        """The worker's cache hit we expect: the match, less what the worker's rule for a match
        that ends inside an image leaves out."""
        if not rep.parity_ok:
            return 0
        bs = self.ns.block_size
        n = self.matched.get(rep.id, 0) * bs
        return usable_match(n, len(self.prompt), bs, self.prompt.mm_items, rep.mm_match_rule)

    def prediction(self, rep: Replica) -> tuple[int, int]:
        """What the lease charges `rep` with: `predicted_for`, and its host tier's part."""
        return self.predicted_for(rep), self.predicted_host_for(rep)

    def predicted_host_for(self, rep: Replica) -> int:
        """Of `predicted_for`, the tokens `rep`'s host tier is expected to serve: past its
        GPU's hit (each part as the worker's rule for a match inside an image leaves it)."""
        gpu_blocks = self.gpu.get(rep.id)
        if gpu_blocks is None or not rep.parity_ok:
            return 0
        bs, n, mm, rule = (
            self.ns.block_size,
            len(self.prompt),
            self.prompt.mm_items,
            rep.mm_match_rule,
        )
        total = usable_match(self.matched.get(rep.id, 0) * bs, n, bs, mm, rule)
        return total - min(usable_match(gpu_blocks * bs, n, bs, mm, rule), total)

    def speculative_keys(self) -> list[BlockKey]:
        """The keys the replica will hold once it has prefilled the request."""
        return self.keys

    def prefix_hint(self) -> str | None:
        """The `x-kvgate-prefix` value for the replica holding the slot: the hex key of the last
        block of the hit predicted there, which a kvgate worker keeps cached while it renders
        the request (docs/gateway.md); None when no hit is predicted, and for plain vLLM."""
        lease = self.lease
        n = lease.predicted // self.ns.block_size  # the worker refreshes it in either tier
        info = lease.replica.info if lease.replica is not None else None
        if n == 0 or n > len(self.keys) or info is None or info.engine == "vllm":
            return None
        return self.keys[n - 1].hex()
