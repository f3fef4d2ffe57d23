"""Shared fixtures: the generated demo model and free ports on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cluster import free_port  # noqa: F401 (tests import it from here)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from cachekey.demo import write_demo_model

    path = tmp_path_factory.mktemp("demo-model")
    write_demo_model(path)
    yield path
