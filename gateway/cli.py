"""`python -m gateway`: flags -> GatewayConfig -> uvicorn."""

from __future__ import annotations

import argparse
import logging

from gateway.config import POLICY_NAMES, CostWeights, GatewayConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gateway", description="kvgate routing gateway")
    p.add_argument("--workers", default="", help="comma-separated worker base URLs (static)")
    p.add_argument("--discovery", choices=("static", "k8s"), default="static")
    p.add_argument("--k8s-namespace", default=None)
    p.add_argument("--k8s-selector", default=None, help="label selector of worker EndpointSlices")
    p.add_argument("--k8s-service", default=None, help="worker Service name")
    p.add_argument("--k8s-port-name", default="http")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--policy", choices=POLICY_NAMES, default="cache_aware")
    p.add_argument("--model-dir", default=None, help="local render assets (else from workers)")
    p.add_argument("--index-max-blocks", type=int, default=1_000_000)
    p.add_argument("--speculative-ttl", type=float, default=2.0)
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--poll-interval", type=float, default=0.5)
    p.add_argument("--eject-after-failures", type=int, default=3)
    p.add_argument("--eject-seconds", type=float, default=10.0)
    w = CostWeights()
    p.add_argument("--prefill-weight", type=float, default=w.prefill)
    p.add_argument("--load-weight", type=float, default=w.load)
    p.add_argument("--decode-weight", type=float, default=w.decode)
    p.add_argument("--queue-weight", type=float, default=w.queue)
    p.add_argument("--kv-weight", type=float, default=w.kv)
    p.add_argument("--recent-weight", type=float, default=w.recent)
    p.add_argument("--recent-half-life", type=float, default=60.0)
    p.add_argument("--softmax-temperature", type=float, default=0.0)
    p.add_argument("--session-header", default="x-session-id")
    p.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024)
    p.add_argument(
        "--vllm-kv-events-port",
        type=int,
        default=None,
        help="events port of plain vLLM workers (no /kvgate/info)",
    )
    p.add_argument("--vllm-kv-events-replay-port", type=int, default=None)
    p.add_argument("--vllm-kv-events-topic", default="")
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        workers=tuple(args.workers.split(",")) if args.workers else (),
        host=args.host,
        port=args.port,
        policy=args.policy,
        model_dir=args.model_dir,
        index_max_blocks=args.index_max_blocks,
        speculative_ttl=args.speculative_ttl,
        retries=args.retries,
        connect_timeout=args.connect_timeout,
        request_timeout=args.request_timeout,
        poll_interval=args.poll_interval,
        eject_after_failures=args.eject_after_failures,
        eject_seconds=args.eject_seconds,
        weights=CostWeights(
            prefill=args.prefill_weight,
            load=args.load_weight,
            decode=args.decode_weight,
            queue=args.queue_weight,
            kv=args.kv_weight,
            recent=args.recent_weight,
        ),
        recent_half_life=args.recent_half_life,
        softmax_temperature=args.softmax_temperature,
        session_header=args.session_header,
        max_image_bytes=args.max_image_bytes,
        vllm_kv_events_port=args.vllm_kv_events_port,
        vllm_kv_events_replay_port=args.vllm_kv_events_replay_port,
        vllm_kv_events_topic=args.vllm_kv_events_topic,
        discovery=args.discovery,
        k8s_namespace=args.k8s_namespace,
        k8s_selector=args.k8s_selector,
        k8s_service=args.k8s_service,
        k8s_port_name=args.k8s_port_name,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        build_parser().error(str(e))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from gateway.app import create_app

    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        access_log=False,
    )
    return 0
