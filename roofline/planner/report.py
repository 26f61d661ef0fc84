"""Rendering a plan: a readable table, JSON, and the roofline plot."""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Sequence

from roofline.planner.cost_model import Plan, PlanInputs, decode_at, sweep

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def fmt_count(n: float) -> str:
    n = float(n)
    if math.isinf(n):
        return "inf"
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f}{unit}"
    return f"{n:,.2f}" if n != int(n) else f"{int(n):,}"


def _json_default(o: Any):
    if isinstance(o, float) and (math.isinf(o) or math.isnan(o)):
        return None
    return str(o)


def _clean(o: Any):
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, float) and (math.isinf(o) or math.isnan(o)):
        return None
    return o


def to_json(obj: Dict[str, Any]) -> str:
    return json.dumps(_clean(obj), indent=2, default=_json_default)


def render_table(plan: Plan) -> str:
    r, i, m, h = plan.results, plan.inputs, plan.model, plan.hardware
    bw_tbs = h["hbm_bandwidth_bytes_per_s"] / 1e12
    lines: List[str] = []
    head = (f"roofline plan: {m['name']} on {h['name']}"
            f" (TP={i['tp']}{', PP=' + str(i['pp']) if i.get('pp', 1) > 1 else ''}, weights {i['weight_dtype']}, KV {i['kv_dtype']}, block {i['block_size']})")
    lines.append(head)
    lines.append("=" * len(head))
    attn = m["attention"].upper()
    heads = f"{m['heads']}q/{m['kv_heads']}kv x {m['head_dim']}"
    if m["attention"] == "mla":
        heads = f"{m['heads']} heads, latent {m['kv_lora_rank']}+{m['qk_rope_head_dim']}"
    moe = f", MoE {m['experts']}" if "experts" in m else ""
    lines.append(f"model     {fmt_count(m['total_params'])} params ({fmt_count(m['active_params'])} active/token), "
                 f"{m['layers']} layers, {attn} {heads}{moe}")
    meas = f" ({h.get('description') or 'measured'})" if h.get("measured") else ""
    lines.append(f"hardware  {fmt_bytes(h['memory_bytes'])}, {bw_tbs:.4g} TB/s, "
                 f"{h['peak_flops'] / 1e12:.4g} TFLOP/s{meas}")
    lines.append(f"workload  context {i['context']} (max), avg context {i['avg_context']}, batch {i['batch']}"
                 + (f", step overhead {i['step_overhead_s'] * 1e3:.2f} ms" if i["step_overhead_s"] else ""))
    rows = [
        ("", "Memory (per GPU)", ""),
        ("weight_bytes_per_gpu", fmt_bytes(r["weight_bytes_per_gpu"]), "fits" if r["weights_fit"] else "DOES NOT FIT"),
        *([("  ep_size", f"{r['ep_size']}", f"experts whole over DP={i['dp']} x TP={i['tp']} ranks"),
           ("  redundant_experts", fmt_bytes(r["redundant_expert_bytes_per_gpu"]),
            f"{i['num_redundant_experts']} EPLB replicas per MoE layer, this GPU's share"),
           ("  all_to_all_per_step", fmt_bytes(r["all_to_all_bytes_per_step"]),
            f"sent to other ranks per decode step (batch {i['batch']}, uniform routing)")] if "ep_size" in r else []),
        ("kv_bytes_per_token", fmt_bytes(r["kv_bytes_per_token"]), f"{r['kv_bytes_per_token']:,.0f} B, all layers"),
        ("kv_budget", fmt_bytes(r["kv_budget_bytes"]), i["kv_budget_source"]),
        ("kv_blocks", f"{r['kv_blocks']:,}", f"{fmt_bytes(r['kv_block_bytes'])} per block"),
        ("kv_tokens", f"{r['kv_tokens']:,}", "tokens of KV the pool holds"),
        ("max_request_tokens", f"{r['max_request_tokens']:,}",
         "the longest one request it holds (sliding layers: their window)"),
        ("", "Capacity (concurrent sequences)", ""),
        ("max_seqs_at_context", f"{r['max_seqs_at_context']:,}", f"fully grown to {i['context']} tokens"),
        ("naive_max_seqs", f"{r['naive_max_seqs']:,}", f"contiguous reservation of {i['context']} tokens each"),
        ("paged_max_seqs", f"{r['paged_max_seqs']:,}", f"paged, at avg context {i['avg_context']}"),
        ("", f"Decode at batch {i['batch']}, context {i['avg_context']}", ""),
        ("decode_step_ms", f"{r['decode_step_ms']:.3f}", f"{r['decode_bound']}-bound"),
        ("decode_tokens_per_s", f"{r['decode_tokens_per_s']:,.1f}", "batch / step time"),
        ("  weights read", fmt_bytes(r["decode_weight_bytes_read"]), "once per step"),
        ("  KV read", fmt_bytes(r["decode_kv_bytes_read"]), "batch x context x KV/token"),
        ("decode_intensity", f"{r['decode_intensity_flops_per_byte']:.2f}", "FLOP/byte"),
        ("ridge", f"{r['ridge_flops_per_byte']:.1f}", "FLOP/byte = peak FLOP/s / bandwidth"),
        ("saturation_batch", f"{r['saturation_batch']:.1f}", "KV read = weight read"),
        ("kv_fits_at_batch", "yes" if r["kv_fits_at_batch"] else "NO",
         f"{fmt_bytes(r['kv_bytes_at_batch'])} = {r['kv_blocks_needed_at_batch']:,} blocks"),
        ("", f"Prefill of {i['context']} tokens", ""),
        ("prefill_ms", f"{r['prefill_ms']:.2f}", f"{r['prefill_bound']}-bound at peak, "
                                                   f"intensity {r['prefill_intensity_flops_per_byte']:.0f}"),
    ]
    pipe = r.get("pipeline")
    if pipe is not None:
        rows.append(("", f"Pipeline: {pipe['pp']} stages, {pipe['microbatches']} batches in flight", ""))
        for s in pipe["stages"]:
            rows.append((f"stage {s['stage']}", fmt_bytes(s["weight_bytes"]),
                         f"layers {s['layers'][0]}..{s['layers'][1] - 1}, KV {fmt_bytes(s['kv_bytes_per_token'])}/token, "
                         f"{s['kv_blocks']:,} blocks"))
        rows += [
            ("bubble_fraction", f"{pipe['bubble_fraction']:.3f}", "(pp - 1) / (m + pp - 1)"),
            ("activations_per_decode", fmt_bytes(pipe["activation_bytes_per_decode_step"]),
             f"between stages, batch {i['batch']} (hidden + residual)"),
            ("activations_per_chunk", fmt_bytes(pipe["activation_bytes_per_prefill_chunk"]), "a prefill chunk"),
            ("pp_decode_tokens_per_s", f"{pipe['decode_tokens_per_s']:,.1f}",
             f"round of {pipe['microbatches']} batches = {pipe['decode_round_ms']:.3f} ms"),
        ]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for a, b, _ in rows if a)
    for a, b, c in rows:
        if not a:
            lines.append("")
            lines.append(b)
            continue
        lines.append(f"  {a:<{w0}}  {b:>{w1}}  {c}")
    return "\n".join(lines)


def render_measure_table(rows: Sequence[Dict[str, Any]]) -> str:
    """Predicted vs measured decode step times, one row per batch size."""
    hdr = (f"{'batch':>5}  {'ctx':>5}  {'predicted ms':>12}  {'measured ms':>11}  {'meas/pred':>9}  {'bound':>7}  "
           f"{'tok/s pred':>10}  {'tok/s meas':>10}  {'no-overlap ms':>13}")
    out = [hdr, "-" * len(hdr)]
    for r in rows:
        out.append(f"{r['batch']:>5}  {r['context']:>5.0f}  {r['predicted_ms']:>12.2f}  {r['measured_ms']:>11.2f}  "
                   f"{r['ratio']:>9.2f}  {r['bound']:>7}  {r['predicted_tokens_per_s']:>10.1f}  "
                   f"{r['measured_tokens_per_s']:>10.1f}  {r.get('serial_ms', float('nan')):>13.2f}")
    if any("live_ratio" in r for r in rows):
        out.append("")
        out.append("live roofline (the engine's own per-step accounting, metrics/step_roofline.py), decode steps:")
        out.append(f"{'batch':>5}  {'steps':>5}  {'roofline ms (this BW, F)':>24}  {'live bound ms':>13}  "
                   f"{'live step/bound':>15}")
        for r in rows:
            if "live_ratio" in r:
                out.append(f"{r['batch']:>5}  {r['live_steps']:>5}  {r['live_roofline_ms']:>24.2f}  "
                           f"{r['live_bound_ms']:>13.2f}  {r['live_ratio']:>15.2f}")
    return "\n".join(out)


def plot_batch_sweep(p: PlanInputs, plan: Plan, path: str,
                     measured: Optional[Sequence[Dict[str, Any]]] = None, max_batch: Optional[int] = None) -> str:
    """Decode throughput and step time against batch size, with the compute roof, the bandwidth
    plateau, the saturation batch and the KV memory wall marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = plan.results
    wall = max(int(r["paged_max_seqs"]), 1)
    sat = r["saturation_batch"]
    top = max_batch or int(min(max(4 * wall, 2 * (sat if math.isfinite(sat) else 1), 2 * p.batch, 64), 1 << 14))
    batches = sorted({int(round(x)) for x in [2 ** (k / 8) for k in range(0, int(8 * math.log2(top)) + 1)]})
    rows = sweep(p, batches)
    s = p.avg_context

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    tps = [x["tokens_per_s"] for x in rows]
    ax1.plot(batches, tps, "b-", lw=2, label="predicted decode throughput")
    # compute roof: peak FLOP/s divided by FLOPs per token
    per_tok_flops = decode_at(p, 1)["flops"]
    ax1.axhline(p.peak_flops / per_tok_flops, color="r", ls="--", label="compute roof (peak FLOP/s / FLOP per token)")
    w_read = decode_at(p, 1)["weight_bytes_read"]
    ax1.plot(batches, [b * p.hardware.hbm_bandwidth / w_read for b in batches], "g:",
             label="bandwidth roof, weights only (b x BW / W)")
    kv_tok = r["kv_bytes_per_token"]
    if kv_tok > 0:
        ax1.axhline(p.hardware.hbm_bandwidth / (s * kv_tok), color="m", ls=":",
                    label=f"KV-bandwidth plateau (BW / KV bytes per seq at S={s})")
    ax2.plot(batches, [x["step_ms"] for x in rows], "b-", lw=2, label="predicted step time")
    ax2.plot(batches, [x["memory_ms"] for x in rows], "c--", lw=1, label="memory time (weights + KV) / BW")
    ax2.plot(batches, [x["compute_ms"] for x in rows], "r--", lw=1, label="compute time FLOPs / peak")
    w_ms = w_read / p.hardware.hbm_bandwidth * 1e3
    ax2.axhline(w_ms, color="g", ls=":", label="weight-read floor W / BW")
    for ax in (ax1, ax2):
        if wall <= batches[-1]:
            ax.axvline(wall, color="k", lw=2, label=f"memory wall: {wall} seqs fit in KV at S={s}")
            ax.axvspan(wall, batches[-1], color="0.9")
        else:
            ax.plot([], [], color="k", lw=2, label=f"memory wall: {wall} seqs at S={s} (beyond the chart)")
        if math.isfinite(sat) and sat <= batches[-1]:
            ax.axvline(sat, color="orange", ls="-.", label=f"saturation batch {sat:.0f} (KV read = weight read)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    if measured:
        mb = [m["batch"] for m in measured]
        ax1.plot(mb, [m["measured_tokens_per_s"] for m in measured], "ko", label="measured")
        ax2.plot(mb, [m["measured_ms"] for m in measured], "ko", label="measured")
        if all("predicted_ms" in m for m in measured):
            ax1.plot(mb, [m["batch"] / m["predicted_ms"] * 1e3 for m in measured], "bx", ms=9,
                     label="predicted incl. measured overhead")
            ax2.plot(mb, [m["predicted_ms"] for m in measured], "bx", ms=9, label="predicted incl. measured overhead")
    ax1.set_ylabel("decode tokens / s")
    ax2.set_ylabel("decode step time (ms)")
    ax2.set_xlabel("batch size (concurrent sequences)")
    i, h = plan.inputs, plan.hardware
    ax1.set_title(f"{plan.model['name']} on {h['name']}: TP={i['tp']}, {i['weight_dtype']} weights, "
                  f"{i['kv_dtype']} KV, avg context {s}", fontsize=10)
    ax1.legend(fontsize=7, loc="upper left", framealpha=0.7)
    ax2.legend(fontsize=7, loc="lower right", framealpha=0.7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
