"""manifests/render.py --values/--set: the chart rendered with a user's values, no helm binary.

The script runs as a user runs it (a subprocess of the venv's Python); its output is parsed and
validated against the Kubernetes schemas like every other render in tests/k8s/test_chart.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.paths import CHART, REPO

pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")

SCRIPT = REPO / "manifests" / "render.py"
CPU_DEMO = CHART / "values-cpu-demo.yaml"


def run_render(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def objects(stream: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(stream) if d]


def one(docs: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and (
            component is None
            or d["metadata"]["labels"].get("app.kubernetes.io/component") == component
        )
    ]
    assert len(found) == 1, f"{kind}/{component}: {len(found)}"
    return found[0]


def args_of(obj: dict[str, Any]) -> list[str]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c["args"]


def test_values_files_merge_in_order_then_set(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "worker:\n  replicas: 5\n  maxNumSeqs: 4\n"
        "gateway:\n  image:\n    repository: registry.example.com/ml/kvgate-gateway\n"
    )
    res = run_render(
        "--values",
        CPU_DEMO,
        "-f",
        mine,
        "--set",
        "worker.replicas=3,gateway.policy=round_robin",
        "--namespace",
        "inference",
        "--release",
        "kvgate-prod",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("---\n# Source: kvgate/templates/")
    docs = objects(res.stdout)
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)

    sts = one(docs, "StatefulSet", "worker")
    assert sts["metadata"]["name"] == "kvgate-prod-worker"
    assert sts["spec"]["replicas"] == 3  # --set beats both files
    wargs = args_of(sts)
    assert "--max-num-seqs=4" in wargs  # the later file beats values-cpu-demo.yaml's 8
    assert {"--model=demo", "--device=cpu"} <= set(wargs)  # the earlier file still applies
    # values-cpu-demo.yaml's nulls remove the chart's GPU request.
    assert "nvidia.com/gpu" not in yaml.safe_dump(sts["spec"]["template"]["spec"]["containers"])

    gateway = one(docs, "Deployment", "gateway")
    (gc,) = gateway["spec"]["template"]["spec"]["containers"]
    assert gc["image"].startswith("registry.example.com/ml/kvgate-gateway:")
    assert "--policy=round_robin" in gc["args"]
    (subject,) = one(docs, "RoleBinding")["subjects"]
    assert subject["namespace"] == "inference"


def test_schema_violation_is_named_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("worker:\n  engine: tensorrt\n")
    res = run_render("--values", bad)
    assert res.returncode == 1
    assert "/worker/engine" in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""


def test_unparsable_values_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("worker: [\n")
    res = run_render("-f", bad)
    assert res.returncode == 1
    assert str(bad) in res.stderr and "Traceback" not in res.stderr


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    # Helm keeps the second `worker:` and drops the first without a word.
    twice = tmp_path / "twice.yaml"
    twice.write_text("worker:\n  replicas: 4\ngateway:\n  replicas: 1\nworker:\n  dtype: float16\n")
    res = run_render("-f", twice)
    assert res.returncode == 1 and res.stdout == ""
    assert "line 5: key 'worker' appears twice" in res.stderr and str(twice) in res.stderr


def test_usage_errors(tmp_path: Path) -> None:
    missing = run_render("--values", tmp_path / "nope.yaml")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    both = run_render("--check", "--set", "worker.replicas=1")
    assert both.returncode == 2 and "--check" in both.stderr


def test_defaults_mode_still_checks_manifests() -> None:
    res = run_render("--check")
    assert res.returncode == 0, res.stderr


def test_no_arguments_prints_and_writes_nothing() -> None:
    """As `helm template`: the defaults on stdout; only --write rewrites manifests/."""
    before = {p.name: p.stat().st_mtime_ns for p in (REPO / "manifests").glob("*.yaml")}
    res = run_render()
    assert res.returncode == 0, res.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(res.stdout) if d}
    assert {"Deployment", "StatefulSet", "Service"} <= kinds
    after = {p.name: p.stat().st_mtime_ns for p in (REPO / "manifests").glob("*.yaml")}
    assert after == before


# ---- docs/kubernetes.md: the GPU walkthrough's values, claim and Job are what the chart needs ----


def fenced_blocks(markdown: str, lang: str) -> list[str]:
    """The bodies of the ```lang fenced blocks of a Markdown text, in order."""
    parts = markdown.split(f"```{lang}\n")[1:]
    return [p.split("\n```", 1)[0] for p in parts]


def test_kubernetes_md_values_claim_and_job(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "kubernetes.md").read_text()
    yaml_blocks = fenced_blocks(doc, "yaml")
    (values_block,) = [b for b in yaml_blocks if b.startswith("# my-values.yaml")]
    (heredoc,) = [
        b.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
        for b in fenced_blocks(doc, "bash")
        if "kind: Job" in b
    ]
    for obj in objects(heredoc):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    claim = one(objects(heredoc), "PersistentVolumeClaim")
    job = one(objects(heredoc), "Job")

    (tmp_path / "my-values.yaml").write_text(values_block + "\n")
    res = run_render("-f", tmp_path / "my-values.yaml", "--namespace", "inference")
    assert res.returncode == 0, res.stderr
    docs = objects(res.stdout)
    for d in docs:
        kubernetes_validate.validate(d, kubernetes_validate.latest_version(), strict=True)
    sts = one(docs, "StatefulSet", "worker")
    (wc,) = sts["spec"]["template"]["spec"]["containers"]
    assert wc["image"].startswith("registry.example.com/ml/kvgate-worker:")
    assert sts["spec"]["replicas"] == 4 and "--dtype=bfloat16" in wc["args"]
    # The workers read the claim the doc creates, at the directory its Job downloads into.
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    model_arg = next(a for a in wc["args"] if a.startswith("--model="))
    (download,) = job["spec"]["template"]["spec"]["containers"]
    assert f"--local-dir {model_arg.removeprefix('--model=')}" in download["args"][0]
    assert download["volumeMounts"][0]["mountPath"] == "/models"
