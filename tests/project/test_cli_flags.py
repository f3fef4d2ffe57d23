"""The command lines: flags come from the config dataclasses, every flag says its default,
bad values are usage errors, a port clash names the port, and the docs list every flag."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from gateway import cli as gateway_cli
from gateway.config import CostWeights, GatewayConfig
from gateway.limits import RequestLimits
from harness.ports import free_port
from kvgate_cli.flags import format_pixels, format_size, parse_pixels, parse_size
from tests.support.paths import REPO
from worker import cli as worker_cli
from worker.engine.config import EngineConfig
from worker.server.config import ServerConfig


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def _gateway(*argv: str) -> GatewayConfig:
    return gateway_cli.config_from_args(gateway_cli.build_parser().parse_args(argv))


@pytest.mark.parametrize("cli", [gateway_cli, worker_cli], ids=["gateway", "worker"])
def test_every_flag_has_a_description_and_its_default(cli) -> None:
    parser = cli.build_parser()
    flags = [
        a
        for a in parser._actions
        if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS  # vLLM's aliases
    ]
    assert len(flags) >= 25
    for action in flags:
        text = action.help or ""
        meaning, _, default = text.partition(" (default: ")
        assert meaning.strip() and default.endswith(")"), f"{action.option_strings}: {text!r}"
    assert "(default: info)" in parser.format_help()


def test_defaults_live_only_in_the_config_dataclasses() -> None:
    assert _gateway() == GatewayConfig()
    engine, server = worker_cli.configs_from_args(
        worker_cli.build_parser().parse_args(["--model", "/models/m"])
    )
    assert engine == EngineConfig(model="/models/m") and server == ServerConfig()


def test_gateway_flags_reach_nested_configs_and_lists() -> None:
    cfg = _gateway(
        "--workers",
        "http://a:1,http://b:2",
        "--workers=http://c:3",
        "--recent-weight",
        "0.5",
        "--max-images-per-request",
        "4",
        "--max-inflight-per-replica",
        "0",
        "--no-remote-images",
        "--log-level",
        "debug",
    )
    assert cfg.workers == ("http://a:1", "http://b:2", "http://c:3")
    assert cfg.weights == CostWeights(recent=0.5)
    assert cfg.limits == RequestLimits(max_images=4)
    assert cfg.max_inflight_per_replica is None  # 0: unbounded
    assert cfg.remote_images is False and cfg.log_level == "debug"


def _worker(*argv: str) -> tuple[EngineConfig, ServerConfig]:
    args = worker_cli.build_parser().parse_args(["--model", "/models/m", *argv])
    return worker_cli.configs_from_args(args)


def test_the_worker_takes_vllms_spellings_of_the_flags_it_shares() -> None:
    """A vLLM command line carries over: several adapters after one --lora-modules, each as
    name=path or vLLM's JSON object, and both spellings of a boolean flag."""
    engine, _ = _worker(
        "--lora-modules",
        "a1=/adapters/one",
        '{"name": "a2", "path": "/adapters/two", "base_model_name": "m"}',
        "--lora-modules",
        "a3=/adapters/three,a4=/adapters/four",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--no-enable-lora",
    )
    assert engine.lora_module_paths() == [
        ("a1", "/adapters/one"),
        ("a2", "/adapters/two"),
        ("a3", "/adapters/three"),
        ("a4", "/adapters/four"),
    ]
    assert engine.enable_prefix_caching and engine.enforce_eager
    assert engine.enable_lora  # implied by --lora-modules, as in vLLM
    assert not _worker("--no-enable-prefix-caching")[0].enable_prefix_caching
    assert not _worker("--no-prefix-caching")[0].enable_prefix_caching  # kvgate's own name
    assert _gateway("--remote-images", "--no-remote-images").remote_images is False  # last wins


def test_human_sizes_and_pixels_as_the_docs_write_them() -> None:
    sizes = ("--max-body-bytes", "32MiB", "--max-image-bytes", "20 MiB")
    cfg = _gateway(*sizes, "--max-image-pixels", "4096x4096")
    assert cfg.limits == RequestLimits()
    assert _gateway("--max-body-bytes", "1048576").limits.max_body_bytes == 2**20
    assert parse_size("20MB") == 20_000_000 and parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("64kib") == 65536 and parse_size("7") == 7
    assert parse_pixels("640x480") == 307200 and parse_pixels("1000") == 1000
    for n in (2**20, 20 * 2**20, 3 * 2**30, 1000, 65537):
        assert parse_size(format_size(n)) == n
    assert format_pixels(4096 * 4096) == "4096x4096" and format_pixels(1000) == "1000"
    for bad in ("32XB", "MiB", "-1", "1e3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
    engine, _ = worker_cli.configs_from_args(
        worker_cli.build_parser().parse_args(["--model", "m", "--kv-cache-memory-bytes", "1GiB"])
    )
    assert engine.kv_cache_memory_bytes == 2**30


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("-m", "gateway", "--log-level", "loud"), "argument --log-level: invalid choice: 'loud'"),
        (("-m", "gateway", "--port", "http"), "argument --port: invalid int value: 'http'"),
        (("-m", "gateway", "--max-body-bytes", "32XB"), "argument --max-body-bytes: not a size"),
        (("-m", "gateway", "--discovery", "k8s"), "Kubernetes discovery needs --k8s-namespace"),
        (("-m", "gateway", "--port", "70000"), "port out of range: 70000"),
        (("-m", "worker", "--model", "m", "--log-level", "loud"), "invalid choice: 'loud'"),
        (("-m", "worker"), "the following arguments are required: --model"),
        (("-m", "worker", "--model", "m", "--block-size", "0"), "block_size must be a positive"),
        (
            ("-m", "worker", "--model=m", "--kv-events-port=7", "--kv-events-replay-port=7"),
            "--kv-events-port and --kv-events-replay-port must differ",
        ),
        (
            ("-m", "worker", "--model=m", "--data-parallel-size=2", "--kv-events-port=7",
             "--kv-events-replay-port=8"),
            "the KV-event ports of 2 engines (7-8) and their replay ports (8-9) overlap",
        ),
        (("-m", "gateway", "--workers", "http://a:1;kv-event=5"), "unknown field 'kv-event=5'"),
        (("-m", "gateway", "--workers", "http://a:1;kv-replay=x"), "kv-replay must be a port"),
        (("-m", "gateway", "--workers", "http://a:1,http://a:1/"), "worker listed twice: http://a:1"),
        (("-m", "gateway", "--vllm-kv-events-topic", "kv@{rank}"), "only {host}, {port}, {pod}"),
        (("-m", "gateway", "--kv-events-bind", "tcp://*"), "--kv-events-bind must be tcp://HOST:PORT"),
        (("-m", "gateway", "--max-image-pixels", "14000x14000"), "refuses an image itself"),
        (("-m", "worker", "--model=m", "--max-image-pixels=14000x14000"), "refuses an image"),
    ],
)  # fmt: skip
def test_bad_values_are_usage_errors_not_tracebacks(argv, message) -> None:
    proc = _run(*argv)
    assert proc.returncode == 2, proc.stderr
    assert "usage: python -m" in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def _listening() -> tuple[socket.socket, int]:
    port = free_port()
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock, port


def test_http_port_clash_names_the_port(demo_model_dir) -> None:
    sock, port = _listening()
    with sock:
        gateway = _run("-m", "gateway", "--port", str(port))
        worker = _run(
            "-m", "worker", "--model", str(demo_model_dir), "--engine", "sim",
            "--host", "127.0.0.1", "--port", str(port), "--kv-events-port", "0",
        )  # fmt: skip
    for proc in (gateway, worker):
        assert proc.returncode == 2, proc.stderr
        assert f"cannot listen on 127.0.0.1:{port} (--port {port})" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_events_port_clash_names_the_port(demo_model_dir) -> None:
    events, port = _listening()
    with events:
        proc = _run(
            "-m", "worker", "--model", str(demo_model_dir), "--engine", "sim",
            "--host", "127.0.0.1", "--port", str(free_port()),
            "--kv-events-port", str(port), "--kv-events-replay-port", str(free_port()),
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"cannot bind --kv-events-port {port} (tcp://127.0.0.1:{port})" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_docs_list_every_flag_with_its_default() -> None:
    proc = _run("docs/flag_tables.py", "--check")
    assert proc.returncode == 0, proc.stderr
    for doc, cli in (("gateway.md", gateway_cli), ("worker.md", worker_cli)):
        text = (REPO / "docs" / doc).read_text()
        for action in cli.build_parser()._actions:
            if action.help == argparse.SUPPRESS:
                continue  # vLLM's spelling of a listed boolean flag (docs: one line for all)
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"| `{option}" in text, f"{doc} does not list {option}"
