"""`roofline bench`: throughput (offline workloads), serve (online, against a running server), w8 (PD
interference), eplb (expert parallelism under a skewed router), fp8 (FP8 block weights on the CPU), dsa
(DeepSeek sparse attention against dense MLA) and dbo (dual-batch overlap of the expert exchanges)."""

from __future__ import annotations

from roofline.benchmarks import (
    dual_batch,
    eplb_skew,
    fp8_weights,
    pd_interference,
    serve,
    sparse_attention,
    throughput,
)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (BENCHMARKS.md workloads)")
    sub = p.add_subparsers(dest="bench_command", required=True)
    throughput.register(sub)
    serve.register(sub)
    pd_interference.register(sub)
    eplb_skew.register(sub)
    fp8_weights.register(sub)
    sparse_attention.register(sub)
    dual_batch.register(sub)
