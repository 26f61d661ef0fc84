"""`roofline bench fp8`: FP8 block weights on the CPU against fp32 (issue 35's benchmark).

Two parts, one process, nothing else running:
  gemv   one row through DeepSeek-V3-sized FP8 block weights by the native GEMV (fp8_kernels.c): the weight
         bytes streamed per second, next to a plain memory copy of as many bytes (torch's copy_ of the weight's
         bytes, counted as bytes read + written) and the fp32 GEMV over the same matrix (four times the bytes)
  model  a dummy DeepSeek-V3-shaped model (random weights from transformers' DeepseekV3 with `--hidden`,
         `--layers`, experts ...; projections quantized to [128, 128] e4m3 blocks, written as a checkpoint)
         decoding one stream: tokens/s with the weights kept in blocks (--quantized-weights native) and
         dequantized to fp32 at load, and the weight bytes a decode token reads (the dense parts, plus top-k of
         the routed experts' share)
Medians of `--repeats`.  Prints a table and, with --json, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

GEMV_SHAPES = [(24576, 1536, "q_b_proj"), (7168, 16384, "o_proj"), (4096, 7168, "expert gate_up"),
               (7168, 2048, "expert down"), (36864, 7168, "dense gate_up")]


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_gemv(repeats: int, shapes=GEMV_SHAPES) -> list[dict]:
    import torch

    from roofline.cpu import ops as cpu_ops
    from roofline.model_executor.layers.quantization.fp8 import Fp8BlockTensor, quantize_fp8_blocks

    rows = []
    for n, k, what in shapes:
        g = torch.Generator().manual_seed(n + k)
        dense = torch.randn(n, k, generator=g) * 0.02
        q, s = quantize_fp8_blocks(dense)
        w = Fp8BlockTensor(q, s, 128, 128)
        x = torch.randn(1, k, generator=g)
        t_fp8 = _median_time(lambda: w.linear(x), repeats)
        # the weight's own bytes: a never-written source would read the kernel's one shared zero page from
        # cache and time the writes alone (before 2026-12-03 it did: "copy" was ~1.7x the real copy's rate)
        src = q.reshape(-1).view(torch.uint8).clone()
        dst = torch.empty_like(src)
        t_copy = _median_time(lambda: dst.copy_(src), repeats)
        fp32 = w.dequantize().t().contiguous().t()  # the GEMV's [in x out]-major layout
        t_fp32 = _median_time(lambda: cpu_ops.gemv(x, fp32), repeats)
        weight_bytes = w.nbytes
        rows.append({"shape": [n, k], "what": what, "fp8_us": t_fp8 * 1e6, "fp8_GBps": weight_bytes / t_fp8 / 1e9,
                     "copy_GBps": 2 * n * k / t_copy / 1e9, "fp32_us": t_fp32 * 1e6,
                     "fp32_GBps": 4 * n * k / t_fp32 / 1e9, "fp8_vs_fp32_speedup": t_fp32 / t_fp8,
                     "fp8_stream_vs_copy": (weight_bytes / t_fp8) / (2 * n * k / t_copy)})
        del dense, fp32, src, dst
    return rows


def write_dummy_v3(path: str, hidden: int, layers: int, experts: int, moe_inter: int, seed: int = 0) -> None:
    """A random DeepSeek-V3-shaped checkpoint with every projection in [128, 128] e4m3 blocks."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from roofline.model_executor.layers.quantization.fp8 import quantize_fp8_blocks

    heads = max(hidden // 128, 1)
    cfg = DeepseekV3Config(hidden_size=hidden, intermediate_size=3 * hidden, moe_intermediate_size=moe_inter,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                           q_lora_rank=hidden // 2, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                           v_head_dim=64, n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=4,
                           n_group=4, topk_group=2, first_k_dense_replace=1, vocab_size=32000,
                           max_position_embeddings=4096, tie_word_embeddings=False, num_nextn_predict_layers=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = {}
    with torch.no_grad():
        for name, t in _per_expert(model.state_dict()).items():
            if t.dim() == 2 and name.endswith(".weight") and "proj" in name.rsplit(".", 2)[-2]:
                q, s = quantize_fp8_blocks(t)
                tensors[name], tensors[name + "_scale_inv"] = q, s
            else:
                tensors[name] = t.contiguous()
    os.makedirs(path, exist_ok=True)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128]}
    cfg.save_pretrained(path)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _per_expert(state: dict) -> dict:
    """transformers' fused in-memory experts (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])
    under a checkpoint's per-expert names, as DeepSeek's releases store them."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def decode_tokens_per_s(path: str, mode: str, new_tokens: int, repeats: int) -> dict:
    from roofline import LLM, SamplingParams
    from roofline.benchmarks.throughput import token_read_bytes
    from roofline.model_executor.layers.quantization import quantized_tensors

    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=64,
              quantized_weights=mode, enable_prefix_caching=False)
    prompt = [{"prompt_token_ids": list(range(10, 42))}]

    def run(n):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    t_long = _median_time(lambda: run(new_tokens + 1), repeats)
    t_one = _median_time(lambda: run(1), repeats)
    worker = llm.llm_engine.executor.worker
    read = token_read_bytes(worker.model, 0, 4)  # weights a decode token reads (top-k of the experts)
    out = {"mode": mode, "decode_tok_s": new_tokens / (t_long - t_one), "weight_bytes": sum(worker.weight_bytes.values()),
           "weight_bytes_per_token": read["always_on_weight_bytes"] + read["routed_expert_bytes"],
           "kept_in_blocks": len(quantized_tensors(worker.model))}
    return out


def run(args) -> int:
    import torch

    from roofline.cpu import ops as cpu_ops

    result = {"cpu_isa": cpu_ops.loaded_isa() if cpu_ops.available() else None, "threads": torch.get_num_threads()}
    if args.part in ("all", "gemv"):
        result["gemv"] = bench_gemv(args.repeats)
        print("FP8 block GEMV, one row (median of %d)" % args.repeats)
        print(f"{'shape':>14} {'what':>15} {'fp8 us':>9} {'fp8 GB/s':>9} {'copy GB/s':>10} {'fp8/copy':>9} "
              f"{'fp32 us':>9} {'fp32 GB/s':>10} {'speedup':>8}")
        for r in result["gemv"]:
            print(f"{'x'.join(map(str, r['shape'])):>14} {r['what']:>15} {r['fp8_us']:9.0f} {r['fp8_GBps']:9.1f} "
                  f"{r['copy_GBps']:10.1f} {r['fp8_stream_vs_copy']:9.2f} {r['fp32_us']:9.0f} {r['fp32_GBps']:10.1f} "
                  f"{r['fp8_vs_fp32_speedup']:8.2f}")
    if args.part in ("all", "model"):
        with tempfile.TemporaryDirectory() as d:
            write_dummy_v3(d, args.hidden, args.layers, args.experts, args.moe_intermediate)
            result["model"] = [decode_tokens_per_s(d, mode, args.new_tokens, args.repeats)
                               for mode in ("native", "dequantize")]
        print(f"dummy DeepSeek-V3 shape: hidden {args.hidden}, {args.layers} layers, {args.experts} experts "
              f"(top 4) of width {args.moe_intermediate}; one stream, {args.new_tokens} new tokens")
        for r in result["model"]:
            print(f"  {r['mode']:>10}: {r['decode_tok_s']:7.2f} tok/s, weights {r['weight_bytes'] / 1e6:8.1f} MB, "
                  f"read per token {r['weight_bytes_per_token'] / 1e6:8.1f} MB")
    if args.json:
        print(json.dumps(result))
    return 0


def register(sub) -> None:
    p = sub.add_parser("fp8", help="FP8 block weights on the CPU: GEMV streaming and decode against fp32",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--part", choices=("all", "gemv", "model"), default="all")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
