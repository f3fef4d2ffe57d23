"""The gateway side (gateway, cachekey) must never pull torch into the process."""

from __future__ import annotations

import subprocess
import sys


def test_gateway_and_cachekey_do_not_import_torch():
    code = (
        "import gateway, cachekey, cachekey.render, cachekey.assets, cachekey.demo, sys\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
