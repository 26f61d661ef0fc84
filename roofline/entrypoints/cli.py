"""`roofline` console script: one subcommand per module, each exposing register(subparsers)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Each module defines register(subparsers) which adds its subcommand and sets `func` on it.
SUBCOMMAND_MODULES = [
    "roofline.entrypoints.generate_cmd",
    "roofline.entrypoints.serve_cmd",
    "roofline.entrypoints.router_cmd",
    "roofline.entrypoints.worker_cmd",
    "roofline.planner.cli",
    "roofline.benchmarks.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roofline", description="roofline LLM inference engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
