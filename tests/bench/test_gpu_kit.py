"""`python -m bench.gpu_kit --check`: what a lent GPU machine's image lacks to run bench/gpu.sh,
found by running its code small with every process's imports logged."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.long


def test_the_kit_is_what_the_runs_import_and_the_image_lacks(tmp_path: Path) -> None:
    kit = run_bench("gpu_kit", tmp_path / "kit.json", "--check")
    # The web stack is imported only by the workers' and the gateway's own processes, not by
    # the bench that starts them: the log reaches every process.
    for served in ("fastapi", "uvicorn", "httptools", "starlette"):
        assert served in kit, kit
    assert {"msgspec", "pyzmq", "pydantic"} <= kit.keys(), kit
    # The device's image holds these (and kvgate is the checkout itself).
    assert not {"torch", "numpy", "tokenizers", "safetensors", "xxhash", "kvgate"} & kit.keys()
    for name, version in kit.items():
        assert md.version(name) == version, name  # the versions the tests pass with
