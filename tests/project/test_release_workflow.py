"""The release workflow (.github/workflows/release.yml), linted against GitHub Actions' schema by
check-jsonschema (its vendored schema, no network), and the releases it makes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.support.paths import REPO

WORKFLOW = REPO / ".github" / "workflows" / "release.yml"


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows"]
    return subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=120)


def test_release_workflow_passes_the_linter() -> None:
    got = lint(WORKFLOW)
    assert got.returncode == 0, got.stdout + got.stderr


def test_the_linter_refuses_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "release.yml"
    broken.write_text(WORKFLOW.read_text().replace("runs-on:", "runs_on:", 1))
    got = lint(broken)
    assert got.returncode != 0 and "runs-on" in got.stdout + got.stderr


def test_a_tag_releases_both_images_and_the_chart() -> None:
    wf = yaml.safe_load(WORKFLOW.read_text())
    assert wf[True]["push"]["tags"] == ["v*.*.*"]  # YAML 1.1 reads the key `on` as True
    jobs = wf["jobs"]

    def build_step(job: str) -> dict:
        (step,) = [
            s for s in jobs[job]["steps"] if s.get("uses", "").startswith("docker/build-push")
        ]
        assert (REPO / step["with"]["file"]).is_file() and step["with"]["push"] is True
        return step

    gateway = build_step("gateway-image")["with"]
    assert set(gateway["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}
    flavours = {m["flavour"]: m for m in jobs["worker-image"]["strategy"]["matrix"]["include"]}
    assert set(flavours) == {"cpu", "cuda"}
    assert flavours["cpu"]["torch_index"].endswith("/whl/cpu") and not flavours["cuda"]["suffix"]
    assert (
        "TORCH_INDEX_URL=${{ matrix.torch_index }}"
        in build_step("worker-image")["with"]["build-args"]
    )
    chart = " ".join(s.get("run", "") for s in jobs["chart"]["steps"])
    assert "helm package helm/kvgate" in chart and 'helm push "dist/kvgate-' in chart
    assert "oci://" in chart
    assert set(jobs["chart"]["needs"]) == {"check", "gateway-image", "worker-image"}
    for job in ("gateway-image", "worker-image", "chart"):
        assert jobs[job]["permissions"]["packages"] == "write"
