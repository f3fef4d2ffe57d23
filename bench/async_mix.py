r"""--async-scheduling off and on, on issue 35's workload shape: how many steps are launched ahead,
how many of those carry prompt chunks or admissions, why the others were not, and what a
request costs.

The engine alone (no server): bench.engine_steps' closed loop (two tenants' ~2,450-token system
prompts, 32 users of 3 turns, ~160 new tokens and 16 greedy tokens out per turn, `concurrency`
requests in flight, a user's next turn waiting for its answer), 2,000 KV blocks. Each round runs
both sides in turn (the order rotated), each on a fresh engine warmed up first, and checks that
every conversation, answers included, is the same on both. `calls`: engine steps;
`forward_passes`: those that ran the model. Per request: the thread's CPU time
(the CPU has nothing to overlap, so the option should cost nothing there) and the wall time (what
the overlap gains on a GPU).

    python -m bench.async_mix --rounds 4                          # the demo model, CPU
    python -m bench.async_mix --device cuda --dtype bfloat16 --model llama-1b --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.engine_steps import ClosedLoop
from bench.lib.engine_timing import resolve_model
from bench.lib.report import args_dict, write_json
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine

SIDES = {"off": False, "on": True}


def serve(args: argparse.Namespace, model: str, on: bool) -> tuple[dict, dict[int, list[int]]]:
    """One side's run on a fresh engine: its figures and its conversations."""
    config = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        served_model_name="demo",
        async_scheduling=on,
    )
    engine = LLMEngine(config)
    loop = ClosedLoop(engine, 5, args.system_tokens, args.tail)
    loop.run("warm", args.concurrency, 4, 1, args.max_tokens)
    calls = 0
    step = engine.step

    def counted() -> list:
        nonlocal calls
        calls += 1
        return step()

    engine.step = counted  # type: ignore[method-assign]
    passes = count_passes(engine)
    steps = engine._async
    chained0 = (steps.chained, steps.chained_mixed) if steps else (0, 0)
    refused0 = dict(steps.refused) if steps else {}
    if args.device == "cuda":
        torch.cuda.synchronize()
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    n = loop.run("run", args.concurrency, args.users, args.turns, args.max_tokens)
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    figures = {"cpu_ms": 1000 * cpu / n, "wall_ms": 1000 * wall / n, "calls": calls}
    figures["forward_passes"] = passes[0]
    if steps is not None:
        figures["chained"] = steps.chained - chained0[0]
        figures["mixed"] = steps.chained_mixed - chained0[1]
        refused = {k: v - refused0.get(k, 0) for k, v in steps.refused.items()}
        figures["refused"] = {k: v for k, v in refused.items() if v}
    return figures, loop.history


def count_passes(engine: LLMEngine) -> list[int]:
    """A counter of the forward passes the runner runs (launched or synchronous) from now on."""
    passes = [0]
    runner = engine.runner
    for name in ("execute", "launch"):
        fn = getattr(runner, name)

        def counted(*args: object, _fn=fn) -> object:
            passes[0] += 1
            return _fn(*args)

        setattr(runner, name, counted)
    return passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo", help="directory, 'demo', or a shape name")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/kvgate-bench-models"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-blocks", type=int, default=2000)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=2450)
    ap.add_argument("--tail", type=int, default=160, help="new prompt tokens per turn")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("bench/results/async_mix.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = resolve_model(args.model, args.models_dir, torch.device(args.device))
    per_side: dict[str, list[dict]] = {name: [] for name in SIDES}
    for r in range(args.rounds):
        names = list(SIDES)[r % 2 :] + list(SIDES)[: r % 2]
        runs = {name: serve(args, model, SIDES[name]) for name in names}
        same = runs["off"][1] == runs["on"][1]
        for name in names:
            figures = runs[name][0]
            per_side[name].append({"round": r, **figures})
            print(f"round {r} {name:>3}: {figures}", flush=True)
        print(f"round {r}: every conversation the same off and on: {same}", flush=True)
        if not same:
            raise SystemExit("the answers differ")
    medians = {}
    for key in ("cpu_ms", "wall_ms"):
        off, on = (statistics.median(f[key] for f in per_side[s]) for s in SIDES)
        medians[key] = {"off": off, "on": on, "on_vs_off": on / off}
        print(f"median {key} per request: off {off:.2f}, on {on:.2f}, on/off {on / off:.3f}")
    write_json(args.out, {"args": args_dict(args), "runs": per_side, "medians": medians})


if __name__ == "__main__":
    main()
