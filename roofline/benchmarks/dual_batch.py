"""`roofline bench dbo`: dual-batch overlap of the expert-parallel exchanges, on vs off (issue 35's benchmark).

`--ranks` CPU processes (gloo) form one expert-parallel group, as tensor-parallel ranks of one batch do; each
holds `--experts` / ranks whole experts of a MoE layer (`--hidden` x `--intermediate`, top `--top-k`).  The
router prefers rank 0's experts (eplb-style skew: `--skew` added to their logits), so rank 0 computes more and
the others wait on it.  Every step is `--tokens` tokens through `--layers` such layers; a step runs with the
exchange in one piece (off) and as two overlapped micro-batches (on: the second half's dispatch in flight
while the first half's experts compute, the first half's combine while the second's do).

Reported per rank: the median step time, and the time the rank spent blocked in the exchanges' collectives
(moe/expert_parallel.EXCHANGE_WAIT_S).  Off, all of the exchange's time is blocked time; the fraction hidden
is 1 - blocked(on) / blocked(off).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _rank(rank: int, args, port: int, results) -> None:
    import torch

    from roofline.distributed import parallel_state as ps
    from roofline.distributed.layout import ParallelLayout
    from roofline.model_executor.layers.moe import FusedMoE, RoutingConfig
    from roofline.model_executor.layers.moe import expert_parallel as ep

    torch.set_num_threads(args.threads)
    try:
        ps.init_distributed(rank, args.ranks, "127.0.0.1", port, "bench-dbo", "gloo", 120.0)
        ps.init_model_parallel(ParallelLayout(tp=args.ranks, expert_parallel=True))
        routing = RoutingConfig(top_k=args.top_k, renormalize=True)
        g = torch.Generator().manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layer = FusedMoE(args.experts, args.hidden, args.intermediate, routing)
            layer.w13_weight.data.copy_(torch.randn(layer.w13_weight.shape, generator=g) * 0.02)
            layer.w2_weight.data.copy_(torch.randn(layer.w2_weight.shape, generator=g) * 0.02)
            layer.prepare_cpu()
            layers.append(layer)
        hot = list(range(args.experts // args.ranks))  # rank 0's experts under the initial placement
        x = torch.randn(args.tokens, args.hidden, generator=g)
        logits = torch.randn(args.tokens, args.experts, generator=g)
        logits[:, hot] += args.skew
        out = {}
        for mode in ("off", "on", "off", "on"):  # interleaved: drift hits both alike
            ep.dual_batch_step(mode == "on")
            steps, waits = [], []
            for i in range(args.steps + 1):
                ps.get_control_group() and torch.distributed.barrier(ps.get_control_group())
                w0 = ep.EXCHANGE_WAIT_S[0]
                t = time.perf_counter()
                h = x
                with torch.inference_mode():
                    for layer in layers:
                        h = layer(h, logits)
                if i:  # the first is a warm-up
                    steps.append(time.perf_counter() - t)
                    waits.append(ep.EXCHANGE_WAIT_S[0] - w0)
            out.setdefault(mode, {"step": [], "wait": []})
            out[mode]["step"] += steps
            out[mode]["wait"] += waits
        results.put((rank, {m: {"step_ms": statistics.median(v["step"]) * 1e3,
                                "blocked_ms": statistics.median(v["wait"]) * 1e3} for m, v in out.items()}))
    finally:
        ps.destroy_distributed()


def run(args) -> int:
    import torch.multiprocessing as mp

    from roofline.distributed.launch import free_port

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    by_rank = dict(results.get() for _ in procs)
    print(f"dual-batch overlap: {args.ranks} gloo ranks x {args.threads} threads, {args.layers} MoE layers of "
          f"{args.experts} experts ({args.hidden} x {args.intermediate}, top {args.top_k}), {args.tokens} tokens a "
          f"step, skew {args.skew} to rank 0's experts")
    print(f"{'rank':>4} | {'step off ms':>11} {'step on ms':>10} {'speedup':>7} | {'blocked off':>11} "
          f"{'blocked on':>10} {'hidden':>6}")
    rows = []
    for r in sorted(by_rank):
        d = by_rank[r]
        hidden = 1 - d["on"]["blocked_ms"] / d["off"]["blocked_ms"] if d["off"]["blocked_ms"] else 0.0
        rows.append(dict(rank=r, **{f"{m}_{k}": v for m in d for k, v in d[m].items()}, hidden_fraction=hidden))
        print(f"{r:>4} | {d['off']['step_ms']:11.2f} {d['on']['step_ms']:10.2f} "
              f"{d['off']['step_ms'] / d['on']['step_ms']:7.2f} | {d['off']['blocked_ms']:11.2f} "
              f"{d['on']['blocked_ms']:10.2f} {hidden:6.0%}")
    if args.json:
        print(json.dumps(rows))
    return 0


def register(sub) -> None:
    p = sub.add_parser("dbo", help="dual-batch overlap of the expert-parallel exchanges: on vs off",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--skew", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
