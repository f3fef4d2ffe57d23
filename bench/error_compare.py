"""Two trees' answers to the same bad request bodies, side by side: a layout change must not
change what a client is told.

The bodies: a valid chat request with one field made bad (its type, a bound, a limit, a shape),
and with every pair of bad fields. Each tree answers them twice: over HTTP, through a real
gateway started from that tree with no healthy worker (so a valid body is a 503, a bad one its
4xx), and in process, through the worker's request model worded by the shared validation
(cachekey/openai/validation.py). Every answer is compared whole: status, message, type, param,
code.

    git archive main | tar -x -C /tmp/kvgate-main
    python -m bench.error_compare --baseline /tmp/kvgate-main
    # -> bench/results/error_compare.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

RESULTS = Path("bench/results/error_compare.json")
HOST = "127.0.0.1"
RUN_FLAG = "--one-tree"  # internal: this process's tree answers every body, as JSON lines
MSG = [{"role": "user", "content": "hi"}]
BAD: dict[str, list] = {  # bad values, and a few good ones (their pairs test the order)
    "model": [5, True, ["demo"], {}, ""],
    "messages": [[], "hi", [1], [{"content": "no role"}], None, [[]], {"role": "user"},
                 [{"role": "user", "content": 5}]],
    "n": [0, -1, "2", 2.0, True, 17, 65, 16385, None, 16, "x", [1], 2**63, 1],
    "seed": ["1", 1.5, 2**63, -(2**63) - 1, 2**64, True, None, -1, 2**63 - 1, [1]],
    "temperature": [-1, "1", 2.5, True, -0.001, None, 2, 2.0001, [1]],
    "top_p": [0, 1.5, "x", -1, None, 1, True],
    "top_k": [-2, "3", 1.5, None, -1, 0, True],
    "presence_penalty": [3, -3, "a", 2, None, [1]],
    "frequency_penalty": [2.5, True, -2.5, -2, "x"],
    "stop": [5, ["a", 1], [[1]], "", None, ["a"]],
    "stop_token_ids": [["a"], [1.5], 5, [-1], [True]],
    "ignore_eos": [1, "yes", None, 0],
    "stream": ["true", 1, None, "false"],
    "stream_options": [{"include_usage": "yes"}, 5, {"include_usage": 1}, []],
    "max_tokens": [0, -1, "5", 5.5, 10**9, None, 2**63],
    "max_completion_tokens": [0, "1", -1, 5.0, True],
    "logprobs": [1, "x", True, 0],
    "top_logprobs": [21, -1, "1", 1.5, 20],
    "cache_salt": [5, "", [1]],
    "user": [5, []],
    "tools": ["x", [1], {}],
    "add_generation_prompt": [1, "x"],
    "chat_template_kwargs": [5, []],
    # fields the gateway does not declare: forwarded by it; most the worker refuses (not done)
    "min_p": [-1, 2], "repetition_penalty": [0, -1], "logit_bias": ["x", {"a": 1}],
    "response_format": [5], "best_of": [0], "unknown_field": [1, None, "x"],
    "echo": [1], "suffix": [5], "service_tier": [1],
}  # fmt: skip


# Where the one shared `SamplingFields` (issue 37) may change an answer, by side: the gateway's
# fields kept their order, and only two bounds are new (temperature at most 2, top_k at least
# -1); the worker's sampling fields are all the shared ones now (their bounds, two penalties it
# ignored, and the order its first error is reported in).
def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


SHARED = {
    "gateway": lambda body: sorted(
        k
        for k, v in body.items()
        if _number(v) and ((k == "temperature" and v > 2) or (k == "top_k" and v < -1))
    ),
    "worker": lambda body: sorted(
        {"n", "seed", "temperature", "top_k", "presence_penalty", "frequency_penalty"} & body.keys()
    ),
}


def bodies() -> list[dict]:
    """One bad field, then every pair of bad values of two different fields."""
    items = [(k, v) for k, vs in BAD.items() for v in vs]
    base = {"model": "demo", "messages": MSG, "max_tokens": 4}
    out = [{**base, k: v} for k, v in items]
    for (k1, v1), (k2, v2) in itertools.combinations(items, 2):
        if k1 != k2:
            out.append({**base, k1: v1, k2: v2})
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _gateway(tree: Path, log: Path, dead: int) -> tuple[subprocess.Popen, str]:
    """`tree`'s gateway over one worker at port `dead`, where nothing listens (the same port
    for both trees: the replica's name in a 503 derives from its URL)."""
    port = _free_port()
    args = ["-m", "gateway", "--workers", f"http://{HOST}:{dead}", "--host", HOST,
            "--port", str(port), "--poll-interval", "60"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, *args], cwd=tree, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)  # fmt: skip
    return proc, f"http://{HOST}:{port}"


def one_tree(tree: Path, dead: int) -> None:
    """Every body's two answers from this process's tree, one JSON line each."""
    import httpx
    from pydantic import ValidationError

    from cachekey.openai.validation import validation_error
    from worker.server.protocol import ChatCompletionRequest as WorkerChat

    proc, url = _gateway(tree, Path("/tmp") / f"error-compare-{tree.name}.log", dead)
    try:
        with httpx.Client(timeout=30) as http:
            deadline = time.monotonic() + 60
            while True:
                try:
                    http.get(f"{url}/health")
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.2)
            for body in bodies():
                r = http.post(f"{url}/v1/chat/completions", content=json.dumps(body))
                try:
                    WorkerChat.model_validate(body)
                    worker = None
                except ValidationError as e:
                    worker = validation_error(e.errors()).body()
                except ValueError as e:  # a model validator's own refusal
                    worker = {"value_error": str(e)}
                print(json.dumps({"gateway": [r.status_code, r.json()], "worker": worker}))
    finally:
        proc.terminate()
        proc.wait(10)


def answers(tree: Path, dead: int) -> list[dict]:
    """`tree`'s answers: this script run with only `tree` importable (it may predate it)."""
    out = subprocess.run(
        [sys.executable, __file__, RUN_FLAG, str(tree), str(dead)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="checkout of the code before")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    listed = bodies()
    dead = _free_port()
    ours, theirs = answers(Path.cwd(), dead), answers(args.baseline.resolve(), dead)
    diff: Counter[str] = Counter()
    examples: dict[str, list] = {}
    for body, a, b in zip(listed, ours, theirs, strict=True):
        for side in ("gateway", "worker"):
            if a[side] != b[side]:
                shared = SHARED[side](body)
                key = f"{side}, with {'+'.join(shared)}" if shared else f"{side}: UNEXPLAINED"
                diff[key] += 1
                examples.setdefault(key, [body, b[side], a[side]])
    statuses = Counter(a["gateway"][0] for a in ours)
    unexplained = sum(n for k, n in diff.items() if k.endswith("UNEXPLAINED"))
    print(f"{len(listed)} bodies x 2 (gateway over HTTP, worker model): {sum(diff.values())} "
          f"answers differ, {unexplained} outside the shared sampling fields; this tree's "
          f"gateway statuses {dict(sorted(statuses.items()))}")  # fmt: skip
    for key, n in sorted(diff.items()):
        print(f"  {n:>5}  {key}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"bodies": len(listed), "differ": diff, "examples": examples}
    args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == RUN_FLAG:
        one_tree(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
