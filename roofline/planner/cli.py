"""`roofline plan`: capacity and speed of a model on a GPU from bytes, FLOPs and bandwidth.

    roofline plan --model llama-3-70b --gpu h100-sxm --tp 2 --weight-dtype fp8 --context 2048 --batch 32
    roofline plan --model /path/to/hf/dir --gpu l4 --json
    roofline plan --model llama-3-8b --gpu h100 --plot sweep.png
    roofline plan --measure                      # default model on this machine: predicted vs measured

`register(subparsers)` adds the subcommand to the `roofline` console script.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

DTYPES = ["bf16", "fp16", "fp8", "fp32"]


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default=None,
                   help="preset (llama-2-7b, llama-3-8b, llama-3-70b, qwen3-8b, deepseek-v3, smollm2-135m) or a "
                        "local HF model directory; default: roofline's default model (SmolLM2-135M)")
    p.add_argument("--gpu", default=None, help="h100-sxm, h200, a100-80gb, l4, or cpu (bandwidth/FLOPs measured)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (layers split over them)")
    p.add_argument("--pp-layer-partition", default=None, help="layers per stage, e.g. 16,14 (default: even split)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="batches in the pipeline at once, for the bubble (default: --pp)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (expert parallelism spans dp x tp)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE: whole experts over the dp x tp ranks (weights per GPU, all-to-all bytes per step)")
    p.add_argument("--num-redundant-experts", type=int, default=0, help="EPLB replicas per MoE layer")
    p.add_argument("--weight-dtype", choices=DTYPES, default=None, help="default: the checkpoint's dtype")
    p.add_argument("--kv-dtype", choices=DTYPES, default=None, help="default: the weight dtype (bf16 with fp8 weights)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                     help="fraction of device memory for weights + activations + KV (default 0.9)")
    mem.add_argument("--kv-budget-gib", type=float, default=None, help="KV-cache budget per GPU, GiB (exact)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--context", type=int, default=4096, help="max context per sequence (max_model_len)")
    p.add_argument("--avg-context", type=int, default=None, help="average live context (default: --context)")
    p.add_argument("--batch", type=int, default=32, help="decode batch size")
    p.add_argument("--hbm-bandwidth-tbs", type=float, default=None, help="override memory bandwidth (TB/s)")
    p.add_argument("--peak-tflops", type=float, default=None, help="override dense peak TFLOP/s")
    p.add_argument("--memory-gib", type=float, default=None, help="override device memory (GiB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="prefill chunk size used for the activation-memory estimate")
    d = p.add_argument_group("--disagg (prefill/decode engine ratio for a workload)")
    d.add_argument("--disagg", action="store_true",
                   help="size separate prefill and decode engines for the workload below (planner/disagg.py)")
    d.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (default 1024)")
    d.add_argument("--output-len", type=int, default=256, help="output tokens per request (default 256)")
    d.add_argument("--request-rate", type=float, default=10.0, help="requests per second (default 10)")
    d.add_argument("--ttft-slo", type=float, default=1.0, help="mean time-to-first-token SLO, seconds (default 1)")
    d.add_argument("--tpot-slo", type=float, default=0.05, help="time-per-output-token SLO, seconds (default 0.05)")
    d.add_argument("--kv-link-gbs", type=float, default=50.0,
                   help="prefill -> decode KV link bandwidth, GB/s (default 50: InfiniBand HDR)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="plot decode throughput/step time vs batch")
    m = p.add_argument_group("--measure (run the engine here and compare)")
    m.add_argument("--measure", action="store_true", help="measure decode steps on this machine vs prediction")
    m.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    m.add_argument("--dtype", default="float32", help="engine dtype for --measure (default float32)")
    m.add_argument("--measure-batches", default="1,8,32", help="comma-separated batch sizes")
    m.add_argument("--prompt-len", type=int, default=16)
    m.add_argument("--new-tokens", type=int, default=32)
    m.add_argument("--load-format", default="auto", help="engine load format (dummy: random weights)")
    m.add_argument("--no-overhead", action="store_true",
                   help="do not measure the per-step overhead with the empty (narrow) twin of the model")
    m.add_argument("--threads", type=int, default=None,
                   help="torch threads for --measure (default on CPU: 1; a decode step is hundreds of small ops, "
                        "and on a shared or oversubscribed CPU multi-thread synchronisation, which no roofline "
                        "models, can dominate it)")
    return p


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="capacity planner: KV pool, batch limits, decode/prefill time",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def _hardware(args):
    from roofline.planner.hardware import get_hardware

    hw = get_hardware(args.gpu)
    if hw.name == "cpu" and (args.hbm_bandwidth_tbs is None or args.peak_tflops is None):
        import torch

        from roofline.planner.probes import measure_hardware

        torch.set_num_threads(args.threads or 1)  # as --measure does (see --threads)

        wdt = args.weight_dtype or "fp32"
        hw = measure_hardware("cpu", {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(wdt, "float32"))
    return hw.with_overrides(args.hbm_bandwidth_tbs, args.peak_tflops, args.memory_gib)


def run_plan(args) -> int:
    from roofline.config import parse_partition
    from roofline.planner.cost_model import PlanInputs, make_plan
    from roofline.planner.hardware import GiB
    from roofline.planner.model_specs import load_model_spec
    from roofline.planner.report import plot_batch_sweep, render_table, to_json

    if args.gpu is None:
        print("roofline plan: --gpu is required (or use --measure)", file=sys.stderr)
        return 2
    try:
        spec = load_model_spec(args.model)
        hw = _hardware(args)
        p = PlanInputs(
            model=spec, hardware=hw, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
            pp_layer_partition=parse_partition(args.pp_layer_partition, args.pp), dp=args.dp,
            expert_parallel=args.enable_expert_parallel, num_redundant_experts=args.num_redundant_experts,
            weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_budget_bytes=None if args.kv_budget_gib is None else args.kv_budget_gib * GiB,
            block_size=args.block_size, context=args.context, avg_context=args.avg_context, batch=args.batch,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"roofline plan: {e}", file=sys.stderr)
        return 2
    if args.disagg:
        return run_disagg(args, p)
    plan = make_plan(p)
    if args.plot:
        plot_batch_sweep(p, plan, args.plot)
    if args.json:
        d = plan.to_dict()
        if args.plot:
            d["plot"] = args.plot
        print(to_json(d))
    else:
        print(render_table(plan))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 0


def run_disagg(args, p) -> int:
    from roofline.planner.disagg import DisaggWorkload, plan_disagg, render_disagg
    from roofline.planner.report import to_json

    try:
        w = DisaggWorkload(args.input_len, args.output_len, args.request_rate, args.ttft_slo, args.tpot_slo,
                           args.kv_link_gbs * 1e9)
    except ValueError as e:
        print(f"roofline plan: {e}", file=sys.stderr)
        return 2
    d = plan_disagg(p, w)
    print(to_json(d) if args.json else render_disagg(d, p.model.name, p.hardware.name))
    return 0


def run_measure_cmd(args) -> int:
    import torch

    from roofline.planner.cost_model import PlanInputs, make_plan
    from roofline.planner.measure import public, run_measure
    from roofline.planner.report import fmt_bytes, plot_batch_sweep, render_measure_table, to_json

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    threads = args.threads or (1 if device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    batches = [int(x) for x in args.measure_batches.split(",") if x.strip()]
    model = args.model
    if model is not None and model.lower() in ("default", "smollm2-135m", "smollm2-135m-instruct"):
        model = None
    overrides = {k: v for k, v in (("hbm_bandwidth_tbs", args.hbm_bandwidth_tbs), ("peak_tflops", args.peak_tflops),
                                   ("memory_gib", args.memory_gib)) if v is not None}
    res = run_measure(model=model, device=device, dtype=args.dtype, batches=batches, prompt_len=args.prompt_len,
                      new_tokens=args.new_tokens, load_format=args.load_format,
                      measure_overhead=not args.no_overhead, hw_overrides=overrides or None)
    if args.plot:
        avg = int(round(args.prompt_len + args.new_tokens / 2))
        kvc = res.get("kv_pool_check") or {}
        budget = args.kv_budget_gib * (1 << 30) if args.kv_budget_gib else kvc.get("engine_kv_budget_bytes")
        p = PlanInputs(res["_spec"], res["_hardware"], weight_dtype=res["_weight_dtype"],
                       kv_dtype=res["_weight_dtype"], context=args.prompt_len + args.new_tokens, avg_context=avg,
                       batch=max(batches), kv_budget_bytes=budget)
        plot_batch_sweep(p, make_plan(p), args.plot, measured=res["rows"], max_batch=max(256, 4 * max(batches)))
    if args.json:
        d = public(res)
        if args.plot:
            d["plot"] = args.plot
        print(to_json(d))
        return 0
    hw = res["hardware"]
    m = res["model"]
    print(f"roofline plan --measure: {m['name']} ({m['total_params'] / 1e6:.1f}M params, {res['dtype']}) "
          f"on {device}, {res['torch_threads']} torch threads")
    rows = res["rows"]
    bws = ", ".join(f"{r['bandwidth_bytes_per_s'] / 1e9:.1f}" for r in rows)
    fls = ", ".join(f"{r['peak_flops'] / 1e9:.0f}" for r in rows)
    print(f"measured bandwidth (tensor copy, read+write): {hw['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s median "
          f"(per batch: {bws})")
    print(f"measured matmul throughput:                   {hw['peak_flops'] / 1e9:.1f} GFLOP/s median "
          f"(per batch: {fls})")
    print(f"weights read per decode step:                 {fmt_bytes(res['_spec'].weight_params_read(1) * {'fp32': 4, 'bf16': 2, 'fp16': 2}[res['_weight_dtype']])}")
    clock = rows[0].get("clock", "wall") if rows else "wall"
    clock_txt = ("CPU time of the engine thread (1 torch thread; neighbours' time slices excluded)"
                 if clock == "thread_cpu" else "wall clock")
    print(f"decode: {args.prompt_len}-token prompts, {args.new_tokens} new tokens; measured = median engine step, "
          f"timed by {clock_txt}")
    print("predicted = max(bytes/BW, FLOPs/F) + overhead (the empty twin's step at the same batch, minus its own "
          "roofline); BW and F measured with the same clock just before each batch")
    la = [x for x in res.get("loadavg") or [] if x is not None]
    if device == "cpu" and la and max(la) > (res.get("cpu_count") or 1):
        print(f"note: load average {max(la):.1f} on {res.get('cpu_count')} CPUs: other processes share this machine, "
              f"measurements are noisy")
    print()
    print(render_measure_table(res["rows"]))
    if clock == "thread_cpu":
        print("wall-clock median step (ms): " + ", ".join(f"b={r['batch']}: {r['measured_wall_ms']:.2f}" for r in rows))
    print()
    print("batch  roofline ms = max(memory ms, compute ms)  + overhead ms (= empty-twin step - its roofline)")
    for r in res["rows"]:
        print(f"{r['batch']:>5}  {r['roofline_ms']:>11.2f} = max({r['memory_ms']:>8.2f}, {r['compute_ms']:>8.2f})  "
              f"+ {r['overhead_ms']:>8.2f} (= {r.get('empty_step_ms', 0.0):.2f} - {r.get('empty_roofline_ms', 0.0):.2f})")
    kvc = res.get("kv_pool_check")
    if kvc:
        print(f"\nKV pool: engine holds {kvc['engine_kv_tokens']:,} tokens in {fmt_bytes(kvc['engine_kv_budget_bytes'])}; "
              f"planner predicts {kvc['predicted_kv_tokens']:,}")
    if args.plot:
        print(f"\nplot written to {args.plot}")
    return 0


def run(args) -> int:
    if getattr(args, "measure", False):
        return run_measure_cmd(args)
    return run_plan(args)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="roofline")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
