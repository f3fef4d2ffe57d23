"""The shared-prefix workload driven by guidellm, a third-party load tool, through the gateway.

guidellm generates synthetic chats offline (the demo model's tokenizer directory), `--prefix-count`
distinct shared prefixes of `--prefix-tokens` tokens, each followed by a unique question, and sends
them with its own OpenAI client at a fixed concurrency. For each policy a fresh cluster (N sim
workers, `--num-blocks` each, one gateway started with that policy) serves the run. The hit rate
comes from guidellm's own per-request record (`cached_tokens` / `prompt_tokens`, as the server
reported them) and, independently, from the workers' prefix-cache counters, so the figure rests
on neither our client nor our gateway's bookkeeping.

guidellm is not a kvgate dependency, and its current release needs transformers 5, which kvgate's
pins exclude, so it lives in its own virtual environment that sees kvgate's torch:

    python -m bench.guidellm_run --install           # creates ~/.cache/kvgate/guidellm-venv
    python -m bench.guidellm_run                     # table + bench/results/guidellm.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import site
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.lib.report import args_dict, col, columns, percentile, print_table, write_json
from harness import worker_metrics as wm
from harness.cluster import Cluster, ClusterSpec
from worker.demo.model import ensure_demo_model

VENV = Path.home() / ".cache" / "kvgate" / "guidellm-venv"


@dataclass(slots=True)
class Row:
    policy: str = col("policy", 13, left=True)
    requests: int = col("reqs", 5)
    errored: int = col("err", 5)
    # guidellm's per-request cached_tokens / prompt_tokens
    hit_rate: float = col("hit (guidellm)", 16, ".1%")
    worker_hit_rate: float = col("hit (workers)", 15, ".1%")  # the workers' prefix-cache counters
    ttft_p50_ms: float = col("TTFT p50", 10, ".0f", "ms")
    requests_per_s: float
    max_over_mean: float = col("max/mean", 9, ".2f")
    requests_per_replica: list[int]


def guidellm_binary() -> str | None:
    for candidate in (VENV / "bin" / "guidellm", Path(sys.executable).parent / "guidellm"):
        if candidate.exists():
            return str(candidate)
    return shutil.which("guidellm")


def install() -> None:
    """A separate venv that also sees this interpreter's packages (torch above all): guidellm's
    own newer transformers/tokenizers shadow ours there, and this venv is never touched."""
    subprocess.check_call([sys.executable, "-m", "venv", str(VENV)])
    pyver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    pth = VENV / "lib" / pyver / "site-packages" / "_kvgate_base.pth"
    pth.write_text("\n".join(site.getsitepackages()) + "\n")
    import torch  # only to pin its version, so pip never pulls a CUDA build beside it

    constraint = VENV / "torch-constraint.txt"
    constraint.write_text(f"torch=={torch.__version__}\n")
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-c", str(constraint)]
    subprocess.check_call([*pip, "guidellm"])


def run_guidellm(binary: str, url: str, args: argparse.Namespace, out: Path) -> dict:
    data = (
        f"kind=synthetic_text,prompt_tokens={args.question_tokens},"
        f"output_tokens={args.output_tokens},prefix_tokens={args.prefix_tokens},"
        f"prefix_count={args.prefix_count}"
    )
    cmd = [
        binary,
        "run",
        "--backend",
        f"kind=openai_http,target={url},model=demo",
        "--tokenizer",
        f"kind=huggingface_auto,model={args.model_dir}",
        "--data",
        data,
        "--seed",
        f"kind=static,value={args.seed}",
        "--profile",
        f"kind=concurrent,streams={args.concurrency}",
        "--constraint",
        f"kind=max_requests,count={args.requests}",
        "--output",
        f"kind=json,path={out}",
        "--disable-progress",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log = out.with_suffix(".log")
    with log.open("w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"guidellm exited {rc}; command: {' '.join(cmd)}\n{tail}")
    return json.loads(out.read_text())


def make_row(policy: str, report: dict, per_worker: dict[str, wm.WorkerCounters]) -> Row:
    bench = report["benchmarks"][0]
    ok = bench["requests"]["successful"]
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    counts = [round(c.requests) for c in per_worker.values()]
    duration = bench.get("duration") or 0.0
    return Row(
        policy=policy,
        requests=len(ok),
        errored=len(bench["requests"].get("errored") or []),
        hit_rate=cached / prompt if prompt else 0.0,
        worker_hit_rate=wm.hit_rate(per_worker),
        ttft_p50_ms=round(percentile([r["time_to_first_token_ms"] or 0.0 for r in ok], 0.5), 1),
        requests_per_s=round(len(ok) / duration, 2) if duration else 0.0,
        max_over_mean=round(wm.max_over_mean(counts), 2),
        requests_per_replica=counts,
    )


COLUMNS = columns(Row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--install", action="store_true", help=f"install guidellm into {VENV}")
    ap.add_argument("--guidellm", default=None, help="path of the guidellm executable")
    ap.add_argument("--policies", default="cache_aware,round_robin")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=500, help="KV blocks per worker")
    ap.add_argument("--prefix-count", type=int, default=12)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--question-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=Path, default=None, help="tokenizer dir (demo model)")
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/guidellm"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/guidellm.json"))
    args = ap.parse_args()
    if args.install:
        install()
    binary = args.guidellm or guidellm_binary()
    if binary is None:
        sys.exit(f"guidellm not found; run: {sys.executable} -m bench.guidellm_run --install")
    args.model_dir = args.model_dir or ensure_demo_model()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for policy in args.policies.split(","):
        spec = ClusterSpec(
            workers=args.workers,
            engine="sim",
            num_blocks=args.num_blocks,
            policy=policy,
            gateway_args=("--poll-interval", "0.2"),
            log_dir=args.log_dir / policy,
        )
        with Cluster(spec) as c:
            before = wm.scrape_all(c.worker_urls)
            report = run_guidellm(binary, c.gateway_url, args, args.log_dir / f"{policy}.json")
            per_worker = wm.deltas(before, wm.scrape_all(c.worker_urls))
        rows.append(make_row(policy, report, per_worker))
        print_table(rows[-1:], COLUMNS, header=len(rows) == 1)
    hit = {r.policy: r.hit_rate for r in rows}
    summary = {
        "args": args_dict(args),
        "guidellm": binary,
        "results": [asdict(r) for r in rows],
    }
    if hit.get("round_robin") and "cache_aware" in hit:
        summary["cache_aware_over_round_robin"] = round(hit["cache_aware"] / hit["round_robin"], 3)
        print(f"cache_aware / round_robin hit rate: {summary['cache_aware_over_round_robin']:.2f}x")
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
