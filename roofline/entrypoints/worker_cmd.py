"""`roofline worker`: run the ranks of one non-zero node of a multi-node tensor-parallel engine.

    node 0:   roofline serve  MODEL -tp 4 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500
    node 1:   roofline worker MODEL -tp 4 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500

The worker takes the engine configuration from node 0; of its own flags it uses the distributed ones
(-tp, --nnodes, --node-rank, --master-addr, --master-port, --distributed-backend), --device, and
--model / the positional MODEL as this node's path to the checkpoint (default: node 0's path).
It exits 0 when node 0 shuts down, 1 when a rank fails.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from roofline.entrypoints.engine_flags import add_engine_args, engine_args_from


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="this node's path to the checkpoint (default: the path node 0 uses)")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from roofline.distributed.launch import run_worker_node

    overrides = {}
    if getattr(args, "model_pos", None) is not None:
        overrides["model"] = args.model_pos
    try:
        return run_worker_node(engine_args_from(args, **overrides))
    except ValueError as e:
        print(f"roofline worker: error: {e}", file=sys.stderr)
        return 2


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "worker", help="run this node's tensor-parallel ranks of a multi-node engine (node rank >= 1)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    p.set_defaults(func=run)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="roofline worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
