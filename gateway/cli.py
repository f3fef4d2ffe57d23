"""`python -m gateway`: flags -> GatewayConfig -> uvicorn."""

from __future__ import annotations

import argparse
import logging

from gateway.config import POLICY_NAMES, CostWeights, GatewayConfig
from gateway.limits import RequestLimits


def _add_security_flags(p: argparse.ArgumentParser) -> None:
    """Input limits, image fetching, tenants and overload (docs/security.md)."""
    d = RequestLimits()
    g = p.add_argument_group("limits and security (docs/security.md)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    g.add_argument("--max-messages", type=int, default=d.max_messages)
    g.add_argument("--max-content-parts", type=int, default=d.max_content_parts)
    g.add_argument("--max-images-per-request", type=int, default=d.max_images)
    g.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes)
    g.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels)
    g.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="default: the model's max_model_len"
    )
    g.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens)
    g.add_argument("--max-n", type=int, default=d.max_n)
    g.add_argument("--max-json-depth", type=int, default=d.max_json_depth)
    g.add_argument(
        "--max-json-elements",
        type=int,
        default=d.max_json_elements,
        help="values, keys and containers in a request body",
    )
    g.add_argument(
        "--image-fetch-timeout", type=float, default=10.0, help="seconds, all of a request's images"
    )
    g.add_argument(
        "--image-fetch-max-bytes", type=int, default=32 * 2**20, help="all of a request's images"
    )
    g.add_argument(
        "--image-fetch-allow",
        action="append",
        default=[],
        help="host name or CIDR exempt from the SSRF guard (repeat, or comma-separate)",
    )
    g.add_argument("--no-remote-images", action="store_true", help="refuse http(s) image URLs")
    g.add_argument(
        "--allow-image-uuids",
        action="store_true",
        help="let a client's image uuid name the image, scoped to its tenant (default: ignored)",
    )
    g.add_argument("--api-keys-file", default=None, help="key -> tenant (JSON, YAML or lines)")
    g.add_argument(
        "--tenant-salt-secret",
        default=None,
        help="HMAC secret of tenant cache salts (else env KVGATE_TENANT_SALT_SECRET)",
    )
    g.add_argument("--max-inflight-per-replica", type=int, default=256, help="0: unbounded")
    g.add_argument("--max-queue", type=int, default=1024)
    g.add_argument("--queue-timeout", type=float, default=30.0)


def _limits_from_args(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        max_body_bytes=args.max_body_bytes,
        max_messages=args.max_messages,
        max_content_parts=args.max_content_parts,
        max_images=args.max_images_per_request,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_n=args.max_n,
        max_json_depth=args.max_json_depth,
        max_json_elements=args.max_json_elements,
    )


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
    p.add_argument(
        "--vllm-kv-events-port",
        type=int,
        default=None,
        help="events port of plain vLLM workers (no /kvgate/info)",
    )
    p.add_argument("--vllm-kv-events-replay-port", type=int, default=None)
    p.add_argument("--vllm-kv-events-topic", default="")
    p.add_argument("--log-level", default="info")
    _add_security_flags(p)
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
        limits=_limits_from_args(args),
        image_fetch_timeout=args.image_fetch_timeout,
        image_fetch_max_bytes=args.image_fetch_max_bytes,
        image_fetch_allow=tuple(
            e.strip() for arg in args.image_fetch_allow for e in arg.split(",") if e.strip()
        ),
        remote_images=not args.no_remote_images,
        allow_image_uuids=args.allow_image_uuids,
        api_keys_file=args.api_keys_file,
        tenant_salt_secret=args.tenant_salt_secret,
        max_inflight_per_replica=args.max_inflight_per_replica or None,
        max_queue=args.max_queue,
        queue_timeout=args.queue_timeout,
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
        if config.api_keys_file:  # fail at start, not on the first request
            from gateway.tenants import TenantRegistry

            TenantRegistry(config.api_keys_file, config.tenant_salt_secret)
    except (OSError, ValueError) as e:
        build_parser().error(str(e))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every health, info and metrics poll at INFO; keep those out of the gateway's log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
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
