"""Shared fixtures: the generated demo model and free ports on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from cachekey.demo import write_demo_model

    path = tmp_path_factory.mktemp("demo-model")
    write_demo_model(path)
    yield path
