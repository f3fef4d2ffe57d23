"""`make images-test`: build both images, check what they hold, and run them against each other
as the chart runs them.

The containers take the arguments, environment, user and emptyDir mounts of the chart's CPU demo
(helm/kvgate/values-cpu-demo.yaml, rendered by Helm's engine): uid 10001 with group 10001, a
read-only root filesystem, no capabilities, host directories for the emptyDirs, the shared
worker token. They share the host's network and listen on 127.0.0.1. The gateway discovers the
worker from --workers instead of the Kubernetes API. Passing means: each image holds exactly its
lock's versions, the gateway's /health is green, and a chat completion through it reaches the
worker.

    python -m harness.images --engine podman [--torch-wheel PATH] [--base-image IMAGE]
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness.image_checks import check_image, cpu_torch_wheel
from harness.image_pods import Pod, chart_pods
from harness.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
RUNNERS = ("docker", "podman")


def build(args: argparse.Namespace) -> None:
    """`make images` with this engine: the one build recipe, as a user runs it."""
    cmd = ["make", "--no-print-directory", "images", f"DOCKER={args.engine}"]
    cmd += [f"REGISTRY={args.registry}", f"IMAGE_TAG={args.tag}"]
    if args.base_image:
        cmd.append(f"BASE_IMAGE={args.base_image}")
    wheel = args.torch_wheel or cpu_torch_wheel()
    if wheel:
        print(f"images-test: the worker installs torch from {wheel}")
        cmd.append(f"TORCH_WHEEL={wheel}")
    else:
        print("images-test: no local CPU torch wheel; the worker takes PyTorch's CPU index")
        cmd.append("TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"images-test: built both images in {time.monotonic() - t0:.0f}s")


def run(engine: str, pod: Pod, name: str, home: Path) -> None:
    """Start `pod` detached, as the chart's securityContext and volumes describe it."""
    flags = ["run", "-d", "--name", name, "--network", "host"]
    flags += ["--user", f"{pod.uid}:{pod.gid}", "--group-add", str(pod.gid)]
    flags += ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    if engine == "podman":  # podman's --read-only adds tmpfs on /tmp, /run: the chart has none
        flags.append("--read-only-tmpfs=false")
    for i, path in enumerate(pod.mounts):
        host = home / f"{name}-{i}"
        host.mkdir()
        host.chmod(0o777)  # an emptyDir the pod's fsGroup may write
        flags += ["-v", f"{host}:{path}"]
    for key, value in pod.env.items():
        flags += ["-e", f"{key}={value}"]
    subprocess.run([engine, *flags, pod.image, *pod.args], check=True, stdout=subprocess.DEVNULL)


def logs(engine: str, name: str) -> str:
    out = subprocess.run([engine, "logs", "--tail", "30", name], capture_output=True, text=True)
    return out.stdout + out.stderr


def wait_healthy(engine: str, name: str, url: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        state = subprocess.run(
            [engine, "inspect", "-f", "{{.State.Running}}", name], capture_output=True, text=True
        ).stdout.strip()
        if state != "true":
            raise RuntimeError(f"{name} exited:\n{logs(engine, name)}")
        time.sleep(1)
    raise TimeoutError(f"{name}: /health not 200 after {timeout:.0f}s:\n{logs(engine, name)}")


def check_inside(engine: str, name: str, uid: int) -> None:
    """The process runs as the chart's uid and cannot write its root filesystem."""
    got = subprocess.run([engine, "exec", name, "id", "-u"], capture_output=True, text=True)
    assert got.stdout.strip() == str(uid), f"{name}: uid {got.stdout.strip()!r}"
    touch = subprocess.run([engine, "exec", name, "touch", "/opt/kvgate/x"], capture_output=True)
    assert touch.returncode != 0, f"{name}: the root filesystem is writable"


def chat(gateway_url: str) -> httpx.Response:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Hello from images-test"}],
        "max_tokens": 8,
    }
    resp = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, f"chat: {resp.status_code} {resp.text[:500]}"
    assert resp.json()["choices"][0]["message"]["content"] is not None
    assert resp.headers.get("x-kvgate-replica"), "no x-kvgate-replica header"
    return resp


def run_pair(engine: str, gateway_image: str, worker_image: str, timeout: float) -> None:
    ports = {k: free_port() for k in ("http", "events", "replay", "gateway", "admin")}
    worker, gateway = chart_pods(worker_image, gateway_image, ports, secrets.token_hex(16))
    tag = secrets.token_hex(3)
    names = (f"kvgate-worker-{tag}", f"kvgate-gateway-{tag}")
    with tempfile.TemporaryDirectory(prefix="kvgate-images-") as tmp:
        try:
            run(engine, worker, names[0], Path(tmp))
            took = wait_healthy(engine, names[0], f"http://127.0.0.1:{ports['http']}", timeout)
            print(f"images-test: worker healthy after {took:.0f}s")
            run(engine, gateway, names[1], Path(tmp))
            gw = f"http://127.0.0.1:{ports['gateway']}"
            took = wait_healthy(engine, names[1], gw, timeout)
            print(f"images-test: gateway /health green after {took:.0f}s")
            for name, pod in zip(names, (worker, gateway), strict=True):
                check_inside(engine, name, pod.uid)
            resp = chat(gw)
            print(
                f"images-test: chat through the gateway: {resp.status_code}, served by "
                f"{resp.headers['x-kvgate-replica']}, "
                f"{resp.json()['usage']['completion_tokens']} tokens"
            )
        finally:
            subprocess.run([engine, "rm", "-f", *names], capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description="build kvgate's images and run them as the chart does")
    ap.add_argument("--engine", default="podman", help="docker or podman (buildah only builds)")
    ap.add_argument("--registry", default="ghcr.io/kvgate")
    ap.add_argument("--tag", default="0.1.0")
    ap.add_argument("--base-image", default="")
    ap.add_argument("--torch-wheel", default="")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for each /health")
    args = ap.parse_args()
    if args.engine not in RUNNERS:
        print(f"images-test runs containers: DOCKER=podman or docker, not {args.engine}")
        return 2
    build(args)
    if args.engine == "podman":  # written by docker/setup-podman.sh, which `make images` ran
        os.environ.setdefault("CONTAINERS_CONF", str(ROOT / "build/podman/containers.conf"))
    gateway_image = f"{args.registry}/kvgate-gateway:{args.tag}"
    worker_image = f"{args.registry}/kvgate-worker:{args.tag}"
    for image, lock in ((gateway_image, "gateway.lock"), (worker_image, "worker.lock")):
        print(check_image(args.engine, image, ROOT / "requirements" / lock))
    run_pair(args.engine, gateway_image, worker_image, args.timeout)
    print("images-test: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
