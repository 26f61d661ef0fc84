"""`roofline serve [MODEL] [engine flags]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import sys

from roofline.config import env_flag
from roofline.entrypoints.engine_flags import add_engine_args, engine_args_from
from roofline.entrypoints.openai.serving_models import parse_lora_module
from roofline.entrypoints.openai.serving_engine import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_COMPLETIONS_PER_REQUEST,
    MAX_PROMPTS_PER_REQUEST,
)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF model directory or .gguf file (same as --model; default: the embedded "
                             "SmolLM2-135M-Instruct)")
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                            "$ROOFLINE_API_KEY, else no key)")
    group.add_argument("--metrics-require-key", action=argparse.BooleanOptionalAction, default=True,
                       help="with --api-key, /metrics needs the key too (default: yes; --no-metrics-require-key "
                            "leaves it open for scrapers that cannot send one)")
    group.add_argument("--request-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                       help=f"seconds a client gets to send its whole request body; then 408 "
                            f"(default: {DEFAULT_BODY_TIMEOUT_S:g})")
    group.add_argument("--request-head-timeout", type=float, default=DEFAULT_HEAD_TIMEOUT_S,
                       help=f"seconds a connection gets to send a complete request head (on opening, and "
                            f"after each answer on a kept-alive one); then it is closed (default: "
                            f"{DEFAULT_HEAD_TIMEOUT_S:g})")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat_template in requests (rendered in a sandboxed process with time, "
                            "memory and size limits); off by default: such requests get 400")
    group.add_argument("--max-template-renders-per-client", type=int, default=2,
                       help="with --trust-request-chat-template, request templates one client address may have "
                            "in flight; 429 beyond (default: 2)")
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    chat = parser.add_argument_group("chat")
    chat.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                      help="the chat template to use instead of the model's: a Jinja file's path, or the template "
                           "itself")
    chat.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                      help="message content as the template wants it: one string, OpenAI's list of text parts, "
                           "or auto (from the template) (default: auto)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='let the model decide to call tools (tool_choice "auto", the default with tools): its '
                           "text is parsed by --tool-call-parser")
    chat.add_argument("--tool-call-parser", default=None,
                      help="how the model writes tool calls: hermes (Hermes, Qwen2.5, SmolLM3), llama3_json, "
                           "mistral, pythonic (Llama 4), deepseek_v3, qwen3_coder")
    chat.add_argument("--reasoning-parser", default=None,
                      help="split a reasoning model's thinking into message.reasoning_content: deepseek_r1, "
                           "qwen3, deepseek_v3 (structured outputs and required tool calls apply after it)")
    group.add_argument("--max-completions-per-request", type=int, default=DEFAULT_MAX_COMPLETIONS_PER_REQUEST,
                       help=f"a request's prompts x n beyond this get 400 (default: "
                            f"{DEFAULT_MAX_COMPLETIONS_PER_REQUEST}); a completions request holds at most "
                            f"{MAX_PROMPTS_PER_REQUEST} prompts")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they "
                            "are aborted (default: 30)")
    group.add_argument("--retry-after", type=int, default=1,
                       help="Retry-After seconds in 503 answers when the queue is full (default: 1)")
    group.add_argument("--log-stats-interval", type=float, default=10.0,
                       help="seconds between throughput log lines while busy; 0 disables (default: 10)")
    lora = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="LoRA adapters (PEFT directories) a request selects with \"model\": NAME; each "
                           "name=path, or a JSON object {\"name\": ..., \"path\": ..., \"base_model_name\": ...} "
                           "(/v1/models lists base_model_name as the adapter's parent); checked at start-up")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="add POST /v1/load_lora_adapter {\"lora_name\", \"lora_path\"} and "
                           "/v1/unload_lora_adapter {\"lora_name\"} (under --api-key like every route but "
                           "/health); off by default")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    group.add_argument("--disable-access-log", action="store_true", help="do not log each HTTP request")
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from roofline.entrypoints.openai.server import ServerConfig, run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"roofline serve: MODEL {args.model_tag!r} and --model {args.model!r} disagree")
        args.model = args.model_tag
    engine_args = engine_args_from(args)
    try:
        lora_modules = tuple(parse_lora_module(m) for m in args.lora_modules)
    except ValueError as e:
        raise SystemExit(f"roofline serve: {e}") from None
    if (lora_modules or args.allow_runtime_lora_updating) and not engine_args.enable_lora:
        raise SystemExit("roofline serve: --lora-modules and --allow-runtime-lora-updating need --enable-lora")
    api_key = args.api_key if args.api_key is not None else (env_flag("ROOFLINE_API_KEY") or None)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=engine_args.served_model_name,
        api_key=api_key,
        metrics_require_key=args.metrics_require_key,
        max_request_body_bytes=args.max_request_body_bytes,
        max_completions_per_request=args.max_completions_per_request,
        request_body_timeout=args.request_body_timeout,
        request_head_timeout=args.request_head_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
        max_template_renders_per_client=args.max_template_renders_per_client,
        chat_template=args.chat_template,
        chat_template_content_format=args.chat_template_content_format,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        shutdown_timeout=args.shutdown_timeout,
        retry_after=args.retry_after,
        log_stats_interval=args.log_stats_interval,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_access_log,
        lora_modules=lora_modules,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )
    try:
        return run_server(engine_args, config)
    except ValueError as e:  # a bad flag (a parser's name, a chat template): said before anything loads
        raise SystemExit(f"roofline serve: {e}") from None


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="start the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /metrics, ...).")
    add_server_args(parser)
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """`python -m roofline.entrypoints.serve_cmd ...` (same as `roofline serve ...`)."""
    parser = argparse.ArgumentParser(prog="roofline")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        argv = ["serve", *argv]
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
