"""Where the repository's files are, for tests that read them or run them."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
CHART = REPO / "helm" / "kvgate"
