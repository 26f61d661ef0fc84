"""`roofline router`: the OpenAI-compatible proxy in front of engines (roofline/router/).

    roofline router --prefill http://p0:8100 --decode http://d0:8200 [--decode ...]   # PD
    roofline router --replica http://r0:8000 --replica http://r1:8000 --policy prefix_aware
"""

from __future__ import annotations

import argparse
import logging
import sys

from roofline.router.policies import POLICIES

logger = logging.getLogger(__name__)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                        help="prefill engines (started with kv_role kv_producer); PD mode with --decode")
    parser.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                        help="decode engines (started with kv_role kv_consumer)")
    parser.add_argument("--replica", nargs="+", action="extend", default=[], metavar="URL",
                        help="data-parallel replicas, each serving whole requests")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin",
                        help="which engine of a kind gets a request (default: round_robin)")
    parser.add_argument("--block-tokens", type=int, default=16,
                        help="prefix_aware: prompt tokens per chunk the router matches (default: 16)")
    parser.add_argument("--health-interval", type=float, default=2.0,
                        help="seconds between health checks of every engine (default: 2)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds an engine may take to answer (default: 600)")
    parser.add_argument("--backend-api-key", default=None,
                        help="API key sent to the engines when a client sends none (health checks too)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from roofline.entrypoints.openai.server import bind_socket
    from roofline.router.app import RouterConfig, build_router_app

    try:
        config = RouterConfig(prefill=args.prefill, decode=args.decode, replicas=args.replica, policy=args.policy,
                              block_tokens=args.block_tokens, health_interval=args.health_interval,
                              request_timeout=args.request_timeout, backend_api_key=args.backend_api_key)
    except ValueError as e:
        raise SystemExit(f"roofline router: {e}")
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    mode = (f"PD: {len(config.prefill)} prefill, {len(config.decode)} decode" if config.pd
            else f"{len(config.replicas)} replicas")
    logger.info("router (%s, policy %s) on http://%s:%d", mode, config.policy, host, port)
    server = uvicorn.Server(uvicorn.Config(build_router_app(config), log_level=args.uvicorn_log_level,
                                           timeout_graceful_shutdown=10.0, lifespan="on"))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "router", help="OpenAI-compatible router: prefill/decode disaggregation or data-parallel replicas",
        description="Proxy /v1/completions and /v1/chat/completions to engines: with --prefill/--decode, "
                    "prefill on one engine and decode on another (KV moved by their KV connectors); with "
                    "--replica, balance whole requests over replicas.  /health and /metrics are the router's own.")
    add_router_args(parser)
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """`python -m roofline.entrypoints.router_cmd ...` (same as `roofline router ...`)."""
    parser = argparse.ArgumentParser(prog="roofline")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "router":
        argv = ["router", *argv]
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
