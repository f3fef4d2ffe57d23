"""LLMEngine: the synchronous engine API the worker service drives from one thread.

add_request -> Scheduler (BlockManager) -> runner (torch ModelRunner or SimRunner) -> outputs;
`step` is one iteration of the engine loop (docs/code-map.md, *An engine step*).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cachekey import BlockKey, HashNamespace, Prompt
from cachekey.assets import ModelAssets
from cachekey.errors import PromptTooLongError
from cachekey.events import KVEvent
from cachekey.render import Renderer
from worker.engine.async_steps import AsyncSteps
from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.host_tier import HostTier
from worker.engine.lora_adapter import LoRAError
from worker.engine.lora_manager import LoRAManager, lora_manager
from worker.engine.outputs import CachedBlock, EngineStats, LoRAStats, RequestOutput
from worker.engine.request_checks import check_prompt
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import ScheduledSeq, Scheduler
from worker.engine.sequence import Sequence
from worker.engine.sim_runner import SimRunner

__all__ = ["CachedBlock", "EngineStats", "LLMEngine", "RequestOutput"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.assets = ModelAssets.from_dir(config.model)
        self.renderer = Renderer(self.assets)
        assert config.served_model_name is not None
        self.namespace = HashNamespace(
            config.served_model_name, config.block_size, config.hash_seed
        )
        if config.engine == "torch":
            from worker.engine.model_runner import ModelRunner  # torch only when needed

            self.runner: ModelRunner | SimRunner = ModelRunner(config, self.assets)
        else:
            self.runner = SimRunner(config, self.assets)
        model_limit = min(self.assets.max_model_len, self.runner.max_model_len)
        if config.max_model_len is not None and config.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's {model_limit}"
            )
        self.max_model_len = config.max_model_len or model_limit
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.mm_match_rule,  # type: ignore[arg-type]  # __post_init__ checked it
            self._host_tier(config),
        )
        self.loras: LoRAManager | None = lora_manager(config, self.runner.lora)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.loras
        )
        # No sequence may outgrow the whole KV cache, or it could never be scheduled again.
        self._max_seq_len = min(self.max_model_len, self.runner.num_blocks * config.block_size)
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._prefix_hint_blocks = 0
        self._async: AsyncSteps | None = None
        if config.async_scheduling and self.runner.overlaps:
            self._async = AsyncSteps(
                self.scheduler, self.runner, self._max_seq_len, self._on_token, self._run
            )

    def _host_tier(self, config: EngineConfig) -> HostTier | None:
        if not config.host_tier_on:
            return None
        slots, copier = self.runner.host_copier(config)
        return HostTier(slots, config.block_size, copier)

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        hidden_states: str | None = None,
        param: str = "messages",
    ) -> None:
        """`hidden_states`: a pooling of hidden_reads.POOLINGS to return when it finishes;
        `param`: the request field the prompt came from, which a too-long prompt's error names."""
        if request_id in self._seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        if lora_name is not None:
            self._lora_manager().get(lora_name)  # 404 for an adapter this worker does not serve
        n = len(prompt.token_ids)
        if n > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens; this model's maximum context length is "
                f"{self.max_model_len}",
                param=param,
            )
        if n >= self._max_seq_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens; the KV cache holds at most {self._max_seq_len} "
                "tokens per request including the first generated one",
                param=param,
            )
        check_prompt(prompt, self.assets.image, self.runner.vocab_size)
        if hidden_states is not None:
            self.runner.hidden.check(hidden_states)
        seq = Sequence(
            request_id, prompt, params, self.namespace, lora_name=lora_name, cache_salt=cache_salt
        )
        self.runner.register(seq)
        if lora_name is not None:
            self._lora_manager().bind(request_id, lora_name)
        if hidden_states is not None:
            self.runner.hidden.want(request_id, hidden_states)
        self._seqs[request_id] = seq
        self._detok[request_id] = IncrementalDetokenizer(
            self.assets.tokenizer, prompt.token_ids, params.stop
        )
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        """Also while a launched step's tokens are unread (--async-scheduling)."""
        inflight = self._async is not None and self._async.inflight is not None
        return inflight or self.scheduler.has_unfinished()

    # -- the step loop -----------------------------------------------------------------------

    def step(self, before_forward: Callable[[], object] | None = None) -> list[RequestOutput]:
        """One engine step: schedule a batch, run its forward pass, turn its tokens into outputs.

        Scheduling admits waiting requests, and their allocations evict cached blocks: those
        evictions are final, so `before_forward` runs once the batch is scheduled and before
        the forward pass (the server publishes the pending KV events there; a gateway routing
        during a long prefill must not predict hits on blocks this step took). The blocks the
        step completes are stored after the forward pass and wait for the next `drain_events`.
        """
        if self._async is not None:
            return self._async.step(before_forward)
        batch = self.scheduler.schedule()
        if before_forward is not None:
            before_forward()
        if not batch:
            return []
        return self._run(batch)

    def _run(self, batch: list[ScheduledSeq]) -> list[RequestOutput]:
        tokens = self.runner.execute(batch)
        self.scheduler.update(batch)
        outputs = []
        for item, token in zip(batch, tokens, strict=True):
            if token is not None:
                outputs.append(self._on_token(item.seq, token))
        return outputs

    def _on_token(self, seq: Sequence, token: int) -> RequestOutput:
        seq.append_token(token, self.namespace)
        self._generation_tokens_total += 1
        queue_s = prefill_s = None
        if seq.num_output_tokens == 1:
            self._prompt_tokens_total += seq.num_prompt_tokens
            queue_s = seq.scheduled_at - seq.arrived_at
            prefill_s = time.monotonic() - seq.scheduled_at
        params = seq.params
        detok = self._detok[seq.request_id]
        reason = None
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.assets.eos_token_ids
        ):
            reason = "stop"  # the stop token itself adds no text
        elif detok.add_tokens((token,)):
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self._max_seq_len:
            reason = "length"
        has_host = self.block_manager.host is not None
        host_cached = seq.num_host_cached_tokens if has_host else None
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            text_delta=detok.take_delta(finished=reason is not None),
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_output_tokens=seq.num_output_tokens,
            num_host_cached_tokens=host_cached,
            queue_s=queue_s,
            prefill_s=prefill_s,
        )
        if reason is not None:
            out.hidden_states = self.runner.hidden.take(seq)  # while seq holds its blocks
            self._finish(seq, reason)
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.runner.release(seq.request_id)
        if self.loras is not None:
            self.loras.unbind(seq.request_id)
        del self._seqs[seq.request_id]
        del self._detok[seq.request_id]

    # -- LoRA adapters -----------------------------------------------------------------------

    def add_lora(self, name: str, path: str, replace: bool = False) -> None:
        self._lora_manager().add(name, path, replace)

    def remove_lora(self, name: str) -> None:
        self._lora_manager().remove(name)

    def _lora_manager(self) -> LoRAManager:
        if self.loras is None:
            raise LoRAError("LoRA is not enabled on this worker (start it with --enable-lora)")
        return self.loras

    # -- cache state -------------------------------------------------------------------------

    def drain_events(self) -> list[KVEvent]:
        """The KV events (stores, evictions, clears) since the last drain, in order."""
        return self.block_manager.drain_events()

    def snapshot_blocks(self) -> list[CachedBlock]:
        return self.block_manager.snapshot()

    def snapshot_host_blocks(self) -> list[CachedBlock]:
        return self.block_manager.host_snapshot()

    def refresh_prefix(self, last: BlockKey) -> int:
        """A request predicted to hit the cached chain ending at `last` is on its way: keep that
        chain from being evicted first (BlockManager.refresh_chain)."""
        n = self.block_manager.refresh_chain(last)
        self._prefix_hint_blocks += n
        return n

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset()

    def stats(self) -> EngineStats:
        vision = self.runner.vision_counters
        counters = self.scheduler.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage(),
            num_blocks=self.block_manager.num_blocks,
            block_size=self.config.block_size,
            prefix_queries_tokens=counters.prefix_queries_tokens,
            prefix_hits_tokens=counters.prefix_hits_tokens,
            encoder_cache_hits=vision.encoder_cache_hits,
            images_processed=vision.images_processed,
            vision_tower_runs=vision.vision_tower_runs,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            hidden_cache_bytes=self.runner.hidden.cache_bytes,
            hidden_queries_tokens=self.runner.hidden.counters.queries_tokens,
            hidden_hits_tokens=self.runner.hidden.counters.hits_tokens,
            prefix_hint_blocks=self._prefix_hint_blocks,
            lora=None if self.loras is None else self._lora_stats(self.loras),
            **self._host_stats(),
        )

    def _host_stats(self) -> dict:
        host = self.block_manager.host
        if host is None:
            return {}
        counters = self.scheduler.counters
        return {
            "host_hits_tokens": counters.host_hits_tokens,
            "host_queries_tokens": counters.prefix_queries_tokens,
            **host.stats(),
        }

    def _lora_stats(self, loras: LoRAManager) -> LoRAStats:
        sched = self.scheduler
        running = [s.lora_name for s in sched.running if s.lora_name is not None]
        waiting = [s.lora_name for s in sched.waiting if s.lora_name is not None]
        return loras.stats(running, waiting)
