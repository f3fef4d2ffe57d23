r"""Where one engine's CPU time goes per request, at each concurrency, on issue 35's workload shape.

The engine alone (no server, no gateway), the demo model on the CPU with one torch thread: two
tenants' ~2,450-token system prompts, 32 users of 3 turns each, every turn adding ~160 new tokens
to the user's conversation and asking for 16 tokens (greedy), in a closed loop that keeps
`concurrency` requests in flight (a user's next turn waits for its last answer). The thread's
CPU time (not the wall clock, which on a shared host mostly measures the other tenants) is
split by part: prefill attention, decode attention, the pure-decode forward, input preparation,
sampling and the whole `ModelRunner.execute`; the rest of `LLMEngine.step` is scheduling,
detokenizing and outputs.

    python -m bench.engine_steps --concurrency 1,16 --rounds 3

To compare two trees, run it in each (copy this file into an older one: it wraps what exists).
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time
from collections.abc import Callable

import torch

from cachekey import Prompt
from worker.demo.model import ensure_demo_model
from worker.engine import decode_attention, model_runner, paged_attention
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

# (owner, attribute, part): wrapped where the owner has it, so older trees run this file too.
PARTS = [
    (paged_attention, "causal_attention", "prefill_attention"),
    (paged_attention, "chunk_after_prefix", "prefill_attention"),
    (decode_attention.ReferenceDecode, "run", "decode_attention"),
    (model_runner.DecodeRunner, "run", "decode_forward"),
    (model_runner, "prepare_inputs", "prepare_inputs"),
    (model_runner.Sampler, "sample", "sample"),
    (model_runner.ModelRunner, "execute", "execute"),
]


def time_parts(totals: collections.Counter) -> None:
    """Add each part's thread CPU seconds to `totals`."""

    def timed(fn: Callable, part: str) -> Callable:
        def call(*args: object, **kw: object) -> object:
            t0 = time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                totals[part] += time.thread_time() - t0

        return call

    for owner, name, part in PARTS:
        fn = getattr(owner, name, None)
        if fn is not None:
            setattr(owner, name, timed(fn, part))


class ClosedLoop:
    """Issue 35's conversations against one engine, `concurrency` requests at a time."""

    def __init__(self, engine: LLMEngine, seed: int, system_tokens: int, tail: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        vocab = engine.runner.vocab_size
        self.systems = [self.random_ids(system_tokens, vocab) for _ in range(2)]
        self.tail, self.vocab = tail, vocab
        self.history: dict[int, list[int]] = {}  # the last run's conversations, answers included

    def random_ids(self, n: int, vocab: int) -> list[int]:
        return [self.rng.randrange(10, vocab) for _ in range(n)]

    def run(self, tag: str, concurrency: int, users: int, turns: int, max_tokens: int) -> int:
        """Serve every turn; the number of requests served."""
        self.history = history = {u: list(self.systems[u % 2]) for u in range(users)}
        queue = [(u, t) for t in range(turns) for u in range(users)]
        live: dict[str, int] = {}
        answers: dict[str, list[int]] = collections.defaultdict(list)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        served = 0
        while queue or live:
            busy = set(live.values())
            for item in [i for i in queue if i[0] not in busy][: concurrency - len(live)]:
                user, turn = item
                queue.remove(item)
                busy.add(user)
                history[user] += self.random_ids(self.tail, self.vocab)
                rid = f"{tag}-{user}-{turn}"
                live[rid] = user
                self.engine.add_request(rid, Prompt(tuple(history[user])), params)
            for out in self.engine.step():
                answers[out.request_id] += out.new_token_ids
                if out.finished:
                    history[live.pop(out.request_id)] += answers.pop(out.request_id)
                    served += 1
        return served


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=2450)
    ap.add_argument("--tail", type=int, default=160, help="new prompt tokens per turn")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = EngineConfig(
        model=str(ensure_demo_model()), device="cpu", num_blocks=2000, served_model_name="demo"
    )
    engine = LLMEngine(config)
    totals: collections.Counter = collections.Counter()
    time_parts(totals)
    loop = ClosedLoop(engine, 5, args.system_tokens, args.tail)
    loop.run("warm", 16, 4, 1, args.max_tokens)
    per_c: dict[int, list[float]] = collections.defaultdict(list)
    for r in range(args.rounds):
        for c in [int(x) for x in args.concurrency.split(",")]:
            totals.clear()
            t0 = time.thread_time()
            n = loop.run(f"r{r}c{c}", c, args.users, args.turns, args.max_tokens)
            cpu_ms = 1000 * (time.thread_time() - t0) / n
            per_c[c].append(cpu_ms)
            parts = ", ".join(f"{k} {1000 * v / n:.2f}" for k, v in sorted(totals.items()))
            print(f"round {r} concurrency {c:>3}: {cpu_ms:.1f} CPU ms/request ({parts})")
    for c, runs in per_c.items():
        print(f"median concurrency {c:>3}: {statistics.median(runs):.1f} CPU ms/request")


if __name__ == "__main__":
    main()
