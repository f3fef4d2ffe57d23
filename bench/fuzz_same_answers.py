"""Do two versions of the code answer the same fuzzed requests the same way?

Draws N request bodies from tests/gateway/test_http_fuzz.py's strategy (derandomized: the same N
every run), starts a sim worker and a gateway from each tree (`--base`, e.g. an export of main,
and this checkout), sends every body to both, and compares the answers: the status, and for an
error its `code` and `param` (messages may word a count differently).

    git archive main | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    .venv/bin/python -m bench.fuzz_same_answers --base /tmp/base --examples 2000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
from hypothesis import HealthCheck, given, settings

from harness.ports import HOST, free_port

# The fuzz's own strategy, so that "the same answers" is about the bodies the suite fuzzes with.
from tests.gateway.test_http_fuzz import raw_requests

HERE = Path(__file__).resolve().parent.parent


def draw(n: int) -> list[tuple[str, bytes, str]]:
    out: list[tuple[str, bytes, str]] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(req=raw_requests())
    def collect(req: tuple[str, bytes, str]) -> None:
        out.append(req)

    collect()
    return out


def start(tree: Path, stack: ExitStack, log_dir: Path) -> str:
    """A sim worker and a gateway running `tree`'s code (`python -m` from it); the gateway URL."""
    wp, ev, rp, gp = (free_port() for _ in range(4))
    log = stack.enter_context((log_dir / f"{tree.name}.log").open("w"))
    worker = ["-m", "worker", "--model", "demo", "--engine", "sim", "--num-blocks", "512"]
    worker += ["--host", HOST, "--port", str(wp)]
    worker += ["--kv-events-port", str(ev), "--kv-events-replay-port", str(rp)]
    gateway = ["-m", "gateway", "--workers", f"http://{HOST}:{wp}", "--host", HOST]
    gateway += ["--port", str(gp), "--poll-interval", "0.5", "--request-timeout", "8"]
    for args in (worker, gateway):
        p = subprocess.Popen([sys.executable, *args], cwd=tree, stdout=log, stderr=log)
        stack.callback(p.terminate)
    url = f"http://{HOST}:{gp}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{tree}: no healthy gateway after 120 s (log: {log.name})")


def answer(url: str, path: str, data: bytes, ctype: str) -> tuple:
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(url + path, content=data, headers=headers, timeout=15)
    if r.status_code < 400:
        return (r.status_code,)
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return (r.status_code, "not an OpenAI error body")
    return (r.status_code, err.get("code"), err.get("param"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="the tree to compare this one with")
    p.add_argument("--examples", type=int, default=2000)
    p.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/fuzz-same-answers"))
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    bodies = draw(args.examples)
    with ExitStack() as stack:
        base = start(args.base.resolve(), stack, args.log_dir)
        this = start(HERE, stack, args.log_dir)
        seen: Counter[int] = Counter()
        differ = []
        for i, (path, data, ctype) in enumerate(bodies):
            a, b = answer(base, path, data, ctype), answer(this, path, data, ctype)
            seen[b[0]] += 1
            if a != b:
                differ.append((i, path, a, b, data[:120]))
    print(f"{len(bodies)} bodies; this tree's answers by status: {dict(sorted(seen.items()))}")
    print(f"answered differently: {len(differ)}")
    for d in differ[:20]:
        print("  ", d)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
