"""One gateway killed mid-run and restarted (bench.fleet_scale --kill-gateway AT,DOWN).

The open-loop driver sends request i to gateway i mod N, so the requests "on" the killed gateway
are those of its index: they may fail while it is down or starting (a load balancer would send
them elsewhere; this driver does not). Every other request must succeed. The hit rate per window
of the run, beside the same trace served with no kill, says how soon it returns to its level.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass

from harness.open_loop import Outcome
from harness.proc import Proc


@dataclass(slots=True)
class KillPlan:
    at: float  # seconds into the run
    down: float  # seconds dead before the restart
    index: int = 0  # which gateway

    @classmethod
    def parse(cls, text: str) -> KillPlan:
        at, down = (float(x) for x in text.split(","))
        return cls(at, down)


class GatewayKiller:
    """Kills `proc` `plan.at` seconds after `start()`, restarts it `plan.down` seconds later."""

    def __init__(self, proc: Proc, plan: KillPlan) -> None:
        self.proc, self.plan = proc, plan
        self.killed = 0.0  # seconds after start()
        self.ready = 0.0  # restarted and healthy, seconds after start()
        self.error = ""
        self._thread = threading.Thread(target=self._run, daemon=True, name="gateway-killer")

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        t0 = time.monotonic()
        time.sleep(self.plan.at)
        self.proc.kill(signal.SIGKILL)
        self.killed = time.monotonic() - t0
        time.sleep(self.plan.down)
        try:
            self.proc.start()
            self.proc.wait_healthy(300)
        except (RuntimeError, TimeoutError) as e:
            self.error = str(e).splitlines()[0]
        self.ready = time.monotonic() - t0


def windows(
    outcomes: list[Outcome], gateways: int, index: int, width: float
) -> list[dict[str, float | int]]:
    """Per `width` seconds of due time: requests, failures on the killed gateway and elsewhere,
    and the hit rate (cached / prompt tokens of the answered requests)."""
    rows: dict[int, dict[str, float | int]] = {}
    for i, o in enumerate(outcomes):
        w = int(o.due // width)
        row = rows.setdefault(
            w, {"from_s": w * width, "requests": 0, "failed_on_it": 0, "failed_elsewhere": 0,
                "cached": 0, "prompt": 0}
        )  # fmt: skip
        row["requests"] += 1
        if not o.ok:
            row["failed_on_it" if i % gateways == index else "failed_elsewhere"] += 1
        row["cached"] += o.cached_tokens
        row["prompt"] += o.prompt_tokens
    out = []
    for w in sorted(rows):
        row = rows[w]
        row["hit_rate"] = round(row.pop("cached") / max(row.pop("prompt"), 1), 3)
        out.append(row)
    return out


def print_windows(base: list[dict], kill: list[dict], killer: GatewayKiller) -> None:
    print(
        f"  gateway {killer.plan.index} killed at {killer.killed:.1f}s, healthy again at "
        f"{killer.ready:.1f}s {killer.error}",
        flush=True,
    )
    print("  | from s | hit (no kill) | hit (kill) | failed on it | failed elsewhere |")
    print("  |---|---|---|---|---|")
    by_from = {r["from_s"]: r for r in base}
    for r in kill:
        b = by_from.get(r["from_s"], {})
        print(
            f"  | {r['from_s']:g} | {b.get('hit_rate', float('nan')):.3f} | {r['hit_rate']:.3f}"
            f" | {r['failed_on_it']} | {r['failed_elsewhere']} |",
            flush=True,
        )
