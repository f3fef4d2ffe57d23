"""`python -m worker`: parse flags, load the engine, serve the API until interrupted."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Sequence

from worker.engine.config import EngineConfig
from worker.server.config import ServerConfig

logger = logging.getLogger("worker")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker", description="kvgate inference worker")
    p.add_argument("--model", required=True, help="model directory, or 'demo' for the tiny model")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--engine", choices=("torch", "sim"), default="torch")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: fraction of GPU memory for weights, activations and the KV cache",
    )
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode")
    p.add_argument("--decode-attention", choices=("auto", "reference", "triton"), default="auto")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--hash-seed", default="kvgate-v1")
    p.add_argument("--kv-events-port", type=int, default=5557, help="0 disables KV events")
    p.add_argument("--kv-events-replay-port", type=int, default=5558, help="0 disables replay")
    p.add_argument("--kv-events-buffer", type=int, default=10_000, help="batches kept for replay")
    p.add_argument("--data-parallel-rank", type=int, default=None)
    p.add_argument("--sim-prefill-s-per-token", type=float, default=0.0)
    p.add_argument("--sim-decode-s-per-step", type=float, default=0.0)
    p.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=30.0,
        help="seconds without a loop iteration before /health fails",
    )
    p.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="serve POST /debug/fault?kind=crash_engine|stall_engine|drop_events&count=N (tests)",
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    return p


def resolve_model(model: str) -> str:
    if model == "demo":
        from cachekey.demo import ensure_demo_model

        return str(ensure_demo_model())
    return model


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    model_path = resolve_model(args.model)
    served = args.served_model_name or ("demo" if args.model == "demo" else None)
    engine_config = EngineConfig(
        model=model_path,
        served_model_name=served,
        engine=args.engine,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        decode_attention=args.decode_attention,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        hash_seed=args.hash_seed,
        sim_prefill_s_per_token=args.sim_prefill_s_per_token,
        sim_decode_s_per_step=args.sim_decode_s_per_step,
    )
    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        kv_events_port=args.kv_events_port,
        kv_events_replay_port=args.kv_events_replay_port,
        kv_events_buffer=args.kv_events_buffer,
        data_parallel_rank=args.data_parallel_rank,
        enable_fault_injection=args.enable_fault_injection,
        engine_stall_timeout_s=args.engine_stall_timeout,
        log_level=args.log_level,
    )
    return engine_config, server_config


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and without it
    # a response written in two parts waits ~40 ms for the client's delayed ACK on keep-alive.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # Listening before the engine is up means early clients queue instead of being refused.
    sock.listen(2048)
    return sock


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine_config, server_config = configs_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import uvicorn
    import zmq

    from worker.engine.llm_engine import LLMEngine
    from worker.server.app import AppState, create_app

    try:
        sock = _bind(server_config.host, server_config.port)
        engine = LLMEngine(engine_config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def ready(state: AppState) -> None:
        events = (
            f"tcp://{server_config.host}:{server_config.kv_events_port}"
            if server_config.events_enabled
            else "disabled"
        )
        print(
            f"kvgate worker ready: http://{server_config.host}:{server_config.port} "
            f"model={state.model_name} engine={engine_config.engine} "
            f"instance={state.instance_id} kv-events={events}",
            flush=True,
        )

    try:
        app = create_app(engine, server_config, on_ready=ready)
    except zmq.ZMQError as e:
        print(f"error: cannot bind the KV-event sockets: {e}", file=sys.stderr)
        return 2
    # Open streams must not hold a SIGTERM'd worker forever.
    uvicorn_config = uvicorn.Config(
        app, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=5
    )
    uvicorn.Server(uvicorn_config).run(sockets=[sock])
    return 0
