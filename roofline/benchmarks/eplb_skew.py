"""`roofline bench eplb`: expert parallelism under a skewed router, before and after EPLB (issue 17's benchmark).

A tiny Mixtral (16 experts, top-2, random weights written by transformers' `save_pretrained`) whose router
prefers a few experts: every token's embedding carries a constant in dimension 0, which survives the
residual stream, and the router's rows of the hot experts (those only rank 0 holds at the start) weigh that
dimension, so most tokens pick them (`--skew` scales the preference; 0 leaves the router uniform).  The
engine runs it expert-parallel over `--ranks` CPU ranks (gloo) with EPLB on, the ranks one tensor-parallel
group (`--layout tp`) or data-parallel attention ranks (`--layout dp`, each its own share of the requests):
`--requests` requests decode together; the first rebalance comes after `--step-interval` steps, and a second one `--step-interval` steps
later measures what the tokens did under the first rebalance's placement.

Reported: balancedness (mean / max tokens per rank, per MoE layer, from the window) before EPLB and after
(measured over the window following the rebalance; the rebalance's own prediction beside it), the median
decode step time before and after, the all-to-all bytes per decode step (rank 0's, median) against `roofline plan`'s
number for the same layout and batch (the planner takes routing as uniform: compare with `--skew 0`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

NUM_EXPERTS = 16


def hot_experts(ranks: int, redundant: int) -> list[int]:
    """The experts only rank 0 holds under the initial placement: a router that prefers them loads rank 0."""
    from roofline.eplb.algorithm import initial_placement

    p = initial_placement(NUM_EXPERTS, ranks, redundant)
    return [e for e in p.rank_slots(0) if len(p.replicas(e)) == 1]


def write_skewed_mixtral(path: str, skew: float, hot: list[int], num_experts: int = NUM_EXPERTS,
                         seed: int = 0) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=num_experts,
                           num_experts_per_tok=2, max_position_embeddings=1024, tie_word_embeddings=False)
    model = MixtralForCausalLM(config)
    with torch.no_grad():
        if skew > 0:
            model.model.embed_tokens.weight[:, 0] = 1.0
            for layer in model.model.layers:
                gate = layer.mlp.gate.weight  # [experts, hidden]
                for i, e in enumerate(hot):
                    gate[e, 0] = skew * (1.0 - 0.2 * i)  # hot, and unevenly so among themselves
    model.save_pretrained(path)


def _decode_steps(llm, requests: int, prompt_len: int, max_tokens: int, interval: int) -> dict[str, Any]:
    from roofline import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(requests):
        eng.add_request(f"r{i}", [(7 * i + 13 * j) % 500 + 5 for j in range(prompt_len)], sp)
    step_times: list[tuple[int, float]] = []  # (rebalances done before the step, seconds)
    step_a2a: list[tuple[int, int]] = []  # (rebalances done before the step, rank 0's all-to-all bytes)
    a2a_seen = 0
    first: dict[str, Any] = {}
    second: dict[str, Any] = {}
    while eng.has_unfinished_requests():
        done = eng.get_stats().eplb_rebalances
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        stats = eng.get_stats()
        a2a_now = stats.collectives.get("ep.all_to_all", [0, 0])[1]
        if stats.eplb_rebalances == done:  # not a rebalancing step
            step_times.append((done, dt))
            step_a2a.append((done, a2a_now - a2a_seen))
        a2a_seen = a2a_now
        if stats.eplb_rebalances >= 1 and not first:
            first = {"before": stats.expert_balancedness_before, "predicted_after": stats.expert_balancedness,
                     "at_step": stats.parallel_steps}
        if stats.eplb_rebalances >= 2 and not second:
            second = {"measured_after": stats.expert_balancedness_before, "at_step": stats.parallel_steps}
    stats = eng.get_stats()
    if stats.num_free_blocks != stats.num_total_blocks:
        raise RuntimeError("KV blocks were not all returned to the pool")
    # decode steps only: the first step of each phase holds prefill chunks
    before = [dt for n, dt in step_times if n == 0][1:interval]
    after = [dt for n, dt in step_times if n == 1][:interval]
    res: dict[str, Any] = {"rebalances": stats.eplb_rebalances}
    if first:
        res["balancedness_before"] = [round(b, 3) for b in first["before"]]
        res["balancedness_predicted_after"] = [round(b, 3) for b in first["predicted_after"]]
    if second:
        res["balancedness_measured_after"] = [round(b, 3) for b in second["measured_after"]]
    a2a_before = [n for d, n in step_a2a if d == 0][1:interval]
    a2a_after = [n for d, n in step_a2a if d == 1][:interval]
    res["a2a_bytes_per_step_before"] = statistics.median(a2a_before) if a2a_before else float("nan")
    res["a2a_bytes_per_step_after"] = statistics.median(a2a_after) if a2a_after else float("nan")
    res["step_ms_before_median"] = 1e3 * statistics.median(before) if before else float("nan")
    res["step_ms_after_median"] = 1e3 * statistics.median(after) if after else float("nan")
    return res


def planner_a2a_bytes(path: str, ranks: int, batch: int, redundant: int) -> float:
    from roofline.planner.cost_model import PlanInputs, expert_parallel_traffic
    from roofline.planner.hardware import get_hardware
    from roofline.planner.model_specs import load_model_spec

    p = PlanInputs(load_model_spec(path), get_hardware("h100-sxm"), tp=ranks, expert_parallel=True,
                   num_redundant_experts=redundant, weight_dtype="fp32", kv_dtype="fp32", batch=batch)
    return expert_parallel_traffic(p)["all_to_all_bytes_per_step"]


def run(args: argparse.Namespace) -> int:
    from roofline.engine.llm import LLM

    results = []
    for skew in args.skew:
        with tempfile.TemporaryDirectory() as d:
            write_skewed_mixtral(d, skew, hot_experts(args.ranks, args.redundant))
            eplb = {"window_size": args.step_interval, "step_interval": args.step_interval,
                    "num_redundant_experts": args.redundant, "log_balancedness": False}
            llm = LLM(d, dtype="float32", device="cpu", num_kv_blocks=1024, show_progress=False,
                      tensor_parallel_size=args.ranks if args.layout == "tp" else 1,
                      data_parallel_size=args.ranks if args.layout == "dp" else 1,
                      enable_expert_parallel=True, enable_eplb=True,
                      eplb_config=json.dumps(eplb), max_num_seqs=args.requests)
            try:
                res = _decode_steps(llm, args.requests, args.prompt_len, 3 * args.step_interval + 4,
                                    args.step_interval)
            finally:
                llm.llm_engine.shutdown()
            res["planner_a2a_bytes_per_step"] = planner_a2a_bytes(d, args.ranks, args.requests, args.redundant)
        res.update(skew=skew, ranks=args.ranks, layout=args.layout, requests=args.requests,
                   redundant_experts=args.redundant)
        results.append(res)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for r in results:
        print(f"{r['layout']} x {r['ranks']}, skew {r['skew']}: balancedness {r.get('balancedness_before')} before EPLB -> "
              f"{r.get('balancedness_measured_after')} after (predicted {r.get('balancedness_predicted_after')}); "
              f"decode step {r['step_ms_before_median']:.1f} -> {r['step_ms_after_median']:.1f} ms; all-to-all "
              f"{r.get('a2a_bytes_per_step_before', 0):.0f} -> {r.get('a2a_bytes_per_step_after', 0):.0f} B/step "
              f"(rank 0), planner (uniform routing) {r['planner_a2a_bytes_per_step']:.0f}")
    return 0


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("eplb", help="expert parallelism under a skewed router, before and after EPLB",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="expert-parallel CPU ranks (default 4)")
    p.add_argument("--layout", choices=("tp", "dp"), default="tp",
                   help="the ranks as one tensor-parallel group (tp: every rank runs the whole batch's attention, "
                        "heads split) or as data-parallel attention (dp: each rank its own requests); the "
                        "experts are spread over all of them either way")
    p.add_argument("--requests", type=int, default=32, help="requests decoding in one batch (default 32)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--step-interval", type=int, default=12, help="EPLB window and interval, in steps (default 12)")
    p.add_argument("--redundant", type=int, default=4, help="EPLB redundant experts per layer (default 4)")
    p.add_argument("--skew", type=float, nargs="+", default=[0.08, 0.0],
                   help="router preference for the hot experts (default: 0.08 and 0, the control)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
