"""The gateway side (gateway, cachekey, kvgate_cli) must never pull torch into the process; nor
must the demo-model generators (worker/demo/), which the gateway's tests and benchmarks run."""

from __future__ import annotations

import subprocess
import sys


def test_gateway_and_cachekey_do_not_import_torch():
    code = (
        "import gateway, gateway.cli, cachekey, cachekey.render, cachekey.assets, sys\n"
        "import cachekey.openai.protocol, cachekey.openai.embeddings, cachekey.openai.validation\n"
        "import kvgate_cli.flags, kvgate_cli.listen\n"
        "import worker.demo.model, worker.demo.hybrid, worker.demo.lora\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
