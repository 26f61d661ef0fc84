"""`roofline bench dsa`: DeepSeek Sparse Attention against dense MLA, one decoding stream (issue 35's benchmark).

A DeepSeek-V3.2-shaped attention layer (`--hidden`, `--heads` MLA heads of 128 + 64 / 128, latent 512 + 64,
the indexer's 64 heads x 128, `--index-topk`; random weights) decodes one token at each `--contexts` length
over a paged cache filled with random latents and index keys (no prefill needed to reach 32k positions on a
CPU).  The same layer runs with its indexer (DSA: scores over the context, top-k, attention over the kept
rows) and without it (dense MLA over every row), on the engine's backend for the device (the CPU's native
kernels here).  Attention per token = the layer's time at that context minus its time at a 16-token context
(the projections, measured in every round beside it; DSA's with its indexer running, so that the indexer's
own projections count as projections, as the planner counts them), times `--layers`; medians over `--rounds`
measurements that alternate DSA and dense, so a slow spell of a shared machine hits both (with `--threads 1`, times are the
thread's CPU time, as the probes take them).  The planner's prediction for the same shapes
(cost_model.attention_time: ModelSpec's DSA-aware cache bytes and FLOPs against the measured copy bandwidth and
the measured FLOP/s of the kernels that run: probes.measure_attention_flops, measure_indexer_flops,
measure_sparse_attention_flops) is printed beside it.  The probes run in every round too, beside the
measurements, and each context's prediction takes their medians over its rounds: probed once at the start they
moved by up to 2x between runs a minute apart on a 2-core Zen 3 (the sparse decode 57-109 GFLOP/s), more than
the measured times, so the prediction's error was the snapshot's, not the model's.
The probes time each kernel call cold (probes._kernel_rate: after reading twice the last-level cache), as a
model runs it: back to back, the few MB a call touches stay in the last-level cache and the probe read ~10-20%
faster than the same call inside the layer, so DSA's prediction leaned low.  The layer's own calls are timed
cold too (probes.cold_median_time): back to back, a 4k context's ~11 MB of one layer's cache rows stayed in the
32 MB last-level cache whenever the machine's neighbours left it alone, and the 4k DSA figure came out
bimodal (10 or 17-24 ms a token on the 2-core Zen 5, against a cold prediction of 18).
"""

from __future__ import annotations

import argparse
import json
import statistics
from types import SimpleNamespace


BASELINE_TOPK = 8  # the DSA baseline layer's index_topk: below its 16-token context, so its indexer runs


def _config(args, dense: bool) -> SimpleNamespace:
    cfg = SimpleNamespace(hidden_size=args.hidden, num_attention_heads=args.heads, qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512, q_lora_rank=args.q_lora_rank,
                          max_position_embeddings=max(args.contexts) + 64, rope_theta=10000.0, attention_bias=False,
                          rope_interleave=True, num_hidden_layers=args.layers)
    if not dense:
        cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim = args.index_topk, 64, 128
    return cfg


def _hf_dict(cfg: SimpleNamespace) -> dict:
    d = dict(vars(cfg), model_type="deepseek_v32", vocab_size=32000, intermediate_size=4 * cfg.hidden_size,
             num_key_value_heads=cfg.num_attention_heads)
    return d


def _layer(cfg):
    from roofline.attention.selector import get_attention_backend
    from roofline.model_executor.layers import cpu_prepare
    from roofline.model_executor.loader.weights import init_dummy_weights
    from roofline.model_executor.models.deepseek import DeepseekMLA

    attn = DeepseekMLA(cfg, get_attention_backend("auto", "cpu"))
    init_dummy_weights(attn, seed=0)
    attn.eval()
    cpu_prepare.prepare_model(attn)
    return attn


def time_decode(attn, context: int, block_size: int, repeats: int) -> float:
    """Median seconds of one decode token at position `context` over random caches (the probes' clock: the
    thread's CPU time when torch runs one thread, else the wall clock), each call timed cold as the planner's
    kernel probes are: inside a model, the other layers' weights and caches pass between two calls of one
    layer, while back to back a 4k context's few MB of cache rows stay in the last-level cache."""
    import torch

    from roofline.planner.probes import cold_median_time

    from roofline.attention.backend import AttentionMetadata

    g = torch.Generator().manual_seed(context)
    nblocks = -(-(context + 1) // block_size)
    caches = [torch.randn((1, nblocks, block_size, 1, spec.head_size), generator=g) * 0.1
              for spec in attn.kv_cache_specs()]
    meta = AttentionMetadata(num_tokens=1, num_reqs=1, num_decodes=1, query_start_loc=torch.tensor([0, 1]),
                             seq_lens=torch.tensor([context + 1]),
                             block_tables=torch.arange(nblocks, dtype=torch.int32)[None],
                             slot_mapping=torch.tensor([context]), max_query_len=1, max_seq_len=context + 1,
                             query_start_loc_cpu=[0, 1], seq_lens_cpu=[context + 1])
    x = torch.randn(1, attn.q_a_proj.weight.shape[1], generator=g)
    positions = torch.tensor([context])
    cos_sin = attn.rotary.cos_sin(positions, x.dtype)
    with torch.inference_mode():
        attn(positions, x, caches, meta, cos_sin)
        return cold_median_time(lambda: attn(positions, x, caches, meta, cos_sin), repeats)


def predicted_attention_s(cfg, context: int, bandwidth: float, rates: dict) -> float:
    """The planner's attention time per token (all layers) at this context (cost_model.attention_time: its
    DSA-aware cache bytes and FLOPs at the measured bandwidth and the rates of the kernels that run)."""
    from roofline.planner.cost_model import attention_time
    from roofline.planner.model_specs import ModelSpec

    return attention_time(ModelSpec.from_hf_config(_hf_dict(cfg)), context, 4, bandwidth, **rates)


def run(args) -> int:
    import torch

    from roofline.planner import probes

    if args.threads:
        torch.set_num_threads(args.threads)

    def probe() -> dict:
        """The machine's figures the planner prices the layer with, measured now."""
        return {"bandwidth": probes.measure_bandwidth("cpu"),
                "attention_flops": probes.measure_attention_flops(),
                "indexer_flops": probes.measure_indexer_flops(topk=args.index_topk),
                "sparse_attention_flops": probes.measure_sparse_attention_flops(topk=args.index_topk)}

    def medians(samples: list) -> dict:
        return {k: statistics.median(x[k] for x in samples) for k in samples[0]}

    all_probes = []
    rows = []
    layers, baselines = {}, {}
    for dense in (False, True):
        layers[dense] = _layer(_config(args, dense))
    # the projections alone, at a 16-token context: for DSA with its indexer running (index_topk 8 < 16), so
    # that the indexer's own projections (wq_b, wk, weights_proj: weights read once a token, which the planner
    # counts with the other weights) come off with the rest and what is left is the part that grows with the
    # context.  Same shapes and seed: the same weights.
    baselines[False] = _layer(_config(argparse.Namespace(**dict(vars(args), index_topk=BASELINE_TOPK)), False))
    baselines[True] = layers[True]
    for context in args.contexts:
        row = {"context": context}
        times = {False: [], True: []}
        base = {False: [], True: []}
        rounds_probes = []
        for _ in range(args.rounds):  # DSA and dense (and each one's projections alone, and the probes)
            rounds_probes.append(probe())  # alternate, so a slow spell of the machine hits all of them
            for dense in (False, True):
                times[dense].append(time_decode(layers[dense], context, args.block_size, args.repeats))
                base[dense].append(time_decode(baselines[dense], 16, args.block_size, args.repeats))
        all_probes += rounds_probes
        probed = medians(rounds_probes)
        rates = {k: v for k, v in probed.items() if k != "bandwidth"}
        for dense, name in ((False, "dsa"), (True, "dense")):
            t = statistics.median(times[dense])
            row[f"{name}_layer_ms"] = t * 1e3
            row[f"{name}_attention_ms_per_token"] = max(t - statistics.median(base[dense]), 0.0) * 1e3 * args.layers
            row[f"{name}_predicted_ms_per_token"] = predicted_attention_s(_config(args, dense), context,
                                                                          probed["bandwidth"], rates) * 1e3
        row["speedup"] = row["dense_attention_ms_per_token"] / max(row["dsa_attention_ms_per_token"], 1e-9)
        row.update({f"probed_{k}": v for k, v in probed.items()})
        rows.append(row)
    overall = medians(all_probes)
    print(f"DeepSeek-V3.2-shaped attention: hidden {args.hidden}, {args.heads} MLA heads, latent 512 + 64, "
          f"indexer 64 x 128, index_topk {args.index_topk}, {args.layers} layers; one decoding stream")
    print(f"measured CPU (medians of every round's probes; each context is predicted with its own rounds'): "
          f"copy {overall['bandwidth'] / 1e9:.1f} GB/s, MLA decode kernel {overall['attention_flops'] / 1e9:.1f} "
          f"GFLOP/s, sparse MLA decode {overall['sparse_attention_flops'] / 1e9:.1f} GFLOP/s, indexer (scores + "
          f"top-k) {overall['indexer_flops'] / 1e9:.1f} GFLOP/s")
    print(f"{'context':>8} | {'dense ms/tok':>12} {'planner':>8} | {'DSA ms/tok':>10} {'planner':>8} | {'speedup':>7}")
    for r in rows:
        print(f"{r['context']:>8} | {r['dense_attention_ms_per_token']:12.1f} {r['dense_predicted_ms_per_token']:8.1f} | "
              f"{r['dsa_attention_ms_per_token']:10.1f} {r['dsa_predicted_ms_per_token']:8.1f} | {r['speedup']:7.2f}")
    if args.json:
        print(json.dumps({"rows": rows, **overall}))
    return 0


def register(sub) -> None:
    p = sub.add_parser("dsa", help="DeepSeek sparse attention against dense MLA: one stream's attention per token",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--q-lora-rank", type=int, default=512)
    p.add_argument("--index-topk", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7, help="timed decodes per measurement (their median)")
    p.add_argument("--rounds", type=int, default=3, help="measurements per context, DSA and dense alternating "
                                                         "(their median)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: as set); with one, every time is the "
                                                           "thread's CPU time (a shared machine's neighbours left out)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
