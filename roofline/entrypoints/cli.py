"""`roofline` console script: one subcommand per module, each exposing register(subparsers).

A command line that names its subcommand imports only that subcommand's module (the server's and the
router's pull in FastAPI, pydantic and httpx, which `roofline generate` never needs); `roofline --help`
and an unknown subcommand build the whole parser.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Optional, Sequence

# subcommand -> the module whose register(subparsers) adds it and sets `func` on it
SUBCOMMAND_MODULES = {
    "generate": "roofline.entrypoints.generate_cmd",
    "serve": "roofline.entrypoints.serve_cmd",
    "router": "roofline.entrypoints.router_cmd",
    "worker": "roofline.entrypoints.worker_cmd",
    "plan": "roofline.planner.cli",
    "bench": "roofline.benchmarks.cli",
}
_TOP_LEVEL_OPTIONS_WITH_VALUE = ("--log-level",)


def named_subcommand(argv: Sequence[str]) -> Optional[str]:
    """The subcommand argv names (its first positional argument), or None."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _TOP_LEVEL_OPTIONS_WITH_VALUE:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return arg
    return None


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The `roofline` parser: every subcommand, or only `only` when it is one of them."""
    parser = argparse.ArgumentParser(prog="roofline", description="roofline LLM inference engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = [SUBCOMMAND_MODULES[only]] if only in SUBCOMMAND_MODULES else SUBCOMMAND_MODULES.values()
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


# Offline commands that hold no server, socket or child process once they return: their process ends
# right after its output is flushed, without the interpreter's teardown (about a second of freeing
# torch's and the model's objects one by one).
_EXIT_AT_ONCE = ("generate",)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(named_subcommand(argv))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


def console_main() -> None:
    """The `roofline` console script: main(), then the process's end."""
    rc = main()
    if named_subcommand(sys.argv[1:]) in _EXIT_AT_ONCE:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    console_main()
