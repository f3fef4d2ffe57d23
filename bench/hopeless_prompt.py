"""What refusing a hopeless prompt costs: tokenizing it whole (before) vs its length alone (after).

A chat of "x " repeated n times, rendered for the demo model (context 4,096 tokens), side by side
in one process, interleaved (the order rotates each round; both sides warm first):
  before: a Renderer without the bound (cachekey/token_bound.py), which tokenizes the whole
          prompt and then refuses it, as the gateway did until issue 39;
  after:  the Renderer as it is, which refuses the prompt by its length before tokenizing.
Each side must refuse with context_length_exceeded. Wall time and the process's CPU time.

    .venv/bin/python -m bench.hopeless_prompt [--rounds 2] [--sizes 600000,6000000]
"""

from __future__ import annotations

import argparse
import time

from cachekey import ModelAssets, Renderer
from cachekey.errors import PromptTooLongError
from worker.demo.model import ensure_demo_model


def refuse(renderer: Renderer, messages: list[dict]) -> tuple[float, float]:
    """(wall s, CPU s) of one render that must be refused as too long, its segment cache
    emptied first (a repeated prompt would be a cache hit: the first sight is what is measured)."""
    renderer._encoder.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        renderer.render_chat(messages)
    except PromptTooLongError:
        return time.perf_counter() - wall, time.process_time() - cpu
    raise AssertionError("the prompt was not refused")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sizes", default="600000,6000000", help="repeats of 'x ' (6,000,000: 12 MB)")
    args = p.parse_args()
    assets = ModelAssets.from_dir(ensure_demo_model())
    after = Renderer(assets)
    before = Renderer(assets)
    before._max_chars = None  # no bound: every prompt tokenized whole
    sides: dict[str, Renderer] = {"before": before, "after": after}
    warm = [{"role": "user", "content": "x " * 30_000}]
    for r in sides.values():
        refuse(r, warm)
    print(f"{'chat':>8} {'round':>5}  {'side':<6} {'wall s':>8} {'cpu s':>8}")
    for n in (int(s) for s in args.sizes.split(",")):
        messages = [{"role": "user", "content": "x " * n}]
        size = f"{2 * n / 1e6:.1f} MB"
        totals = {name: 0.0 for name in sides}
        for i in range(args.rounds):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                wall, cpu = refuse(sides[name], messages)
                totals[name] += wall
                print(f"{size:>8} {i + 1:>5}  {name:<6} {wall:>8.3f} {cpu:>8.3f}", flush=True)
        ratio = totals["before"] / totals["after"]
        print(f"{size:>8}  before/after wall time: {ratio:,.0f}x")


if __name__ == "__main__":
    main()
