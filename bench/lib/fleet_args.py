"""bench.fleet_scale's command line, and what it gives each gateway."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.lib.gateway_kill import KillPlan
from harness.fleet.engine import Timing


def fleet_budget(gateways: int, args: argparse.Namespace) -> list[str]:
    """Each gateway's share of the polls and tail checks the one fleet process answers.

    N real workers answer each gateway's polls in N processes; the fleet answers every replica's
    in one, on the cores the gateways share: 8 gateways at their defaults (100 polls of 3 GETs
    and 50 tail checks a second each) ask it 2,400 GETs and 400 replays a second whatever the
    request rate. Split among the gateways, the fleet answers what it answers for one gateway
    (each replica is then polled by each gateway `gateways` times less often: peers share the
    in-flight load that polls would otherwise have to tell). 0: the gateways' defaults."""
    if not args.fleet_polls_per_second or gateways == 1:
        return []
    polls = args.fleet_polls_per_second / gateways
    tails = args.fleet_tail_checks_per_second / gateways
    return ["--max-polls-per-second", f"{polls:g}", "--max-tail-checks-per-second", f"{tails:g}"]


def quiet_timeout(replicas: int, gateways: int, args: argparse.Namespace) -> float:
    """How long the indexes may take to equal the caches once a point is over: a batch the live
    stream lost is found by a tail check, a replica marked down comes back at a poll, and the
    split above makes each gateway's periods `gateways` times longer (at 512 replicas and 8
    gateways a tail check of each replica every 82 s)."""
    if args.quiet_timeout is not None:
        return args.quiet_timeout
    split = args.fleet_polls_per_second and gateways > 1
    polls = args.fleet_polls_per_second / gateways if split else 100.0
    tails = args.fleet_tail_checks_per_second / gateways if split else 50.0
    return max(60.0, 2 * replicas / min(polls, tails))


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--replicas", type=ints, default=[64, 128, 256, 512])
    ap.add_argument("--gateways", type=ints, default=[1, 4])
    ap.add_argument("--rates", type=floats, default=[10.0, 20.0, 40.0], help="requests/s")
    ap.add_argument("--rr-rate", type=float, help="round robin's rate (default: the first)")
    ap.add_argument("--cache-share", type=float, default=4 / 3)
    ap.add_argument("--users-per-tenant", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=1200)
    ap.add_argument("--prefill-s-per-token", type=float, default=Timing().prefill_s_per_token)
    ap.add_argument("--decode-s-per-step", type=float, default=Timing().decode_s_per_step)
    ap.add_argument("--step-s", type=float, default=Timing().step_s)
    ap.add_argument("--seed", type=int, default=0, help="of the arrival times")
    ap.add_argument("--max-requests", type=int, help="serve only the trace's first requests")
    ap.add_argument("--no-bound", dest="bound", action="store_false")
    ap.add_argument("--no-rr", dest="rr", action="store_false", help="skip round robin")
    ap.add_argument(
        "--peers",
        type=lambda s: [{"off": False, "on": True}[x] for x in s.split(",")],
        default=[False],
        help="off, on or off,on: the gateways (2 or more) share placements and load "
        "(--peer-port, --peers)",
    )
    ap.add_argument(
        "--kill-gateway",
        type=KillPlan.parse,
        metavar="AT,DOWN",
        help="each rate again with gateway 0 killed AT s into the run, restarted DOWN s later",
    )
    _fleet_flags(ap)
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--idle-only", action="store_true", help="measure the idle gateways only")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument(
        "--quiet-timeout",
        type=float,
        help="seconds for the indexes to equal the caches after a point (default: "
        "quiet_timeout, 60 s or two of the gateways' slowest poll or tail-check periods)",
    )
    ap.add_argument("--gateway-args", type=lambda s: tuple(s.split()), default=())
    ap.add_argument(
        "--baseline",
        type=Path,
        action="append",
        default=[],
        help="also run gateways from this checkout (repeatable; labelled by its directory)",
    )
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/fleet_scale"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/fleet_scale.json"))
    return ap


def _fleet_flags(ap: argparse.ArgumentParser) -> None:
    """What the gateways ask of the one fleet process (fleet_budget)."""
    ap.add_argument(
        "--fleet-polls-per-second",
        type=float,
        default=100.0,
        help="polls a second the fleet answers, split among the gateways (their "
        "--max-polls-per-second); 0: each gateway's default (see fleet_budget)",
    )
    ap.add_argument(
        "--fleet-tail-checks-per-second",
        type=float,
        default=50.0,
        help="event tail checks a second the fleet answers, split among the gateways",
    )
