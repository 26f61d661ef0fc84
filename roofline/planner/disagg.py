"""`roofline plan --disagg`: how many prefill and decode engines a workload needs, and their ratio.

The seeds' reasoning (llm-stories-06, deep-dive-08 section 12): prefill is compute-bound and sets TTFT,
decode is bandwidth-bound and sets TPOT; split into two pools, each is sized against its own SLO.

Prefill engine: one prompt of L_in tokens takes t_p (the compute-bound prefill roofline).  Requests
arrive at random and queue, so the engine is an M/D/1 queue (as in DistServe): at utilization
rho = lambda * t_p the mean wait is rho * t_p / (2 (1 - rho)), and
    TTFT = t_p + rho t_p / (2 (1 - rho)) + t_transfer  <=  TTFT SLO
gives the highest rate one prefill engine sustains: rho_max = 2a / (1 + 2a) with
a = (SLO - t_transfer) / t_p - 1, and lambda_p = rho_max / t_p.
Decode engine: the largest batch B whose decode step (weights + B sequences' KV at the mean live
context L_in + L_out / 2, the decode roofline) stays within the TPOT SLO and whose KV
(B x (L_in + L_out) tokens, whole blocks) fits the pool; each request holds a slot for L_out steps,
so one decode engine serves lambda_d = B / (L_out * t_step(B)) requests per second.
Engines: N_p = ceil(rate / lambda_p), N_d = ceil(rate / lambda_d).
KV moved per request: the full prompt blocks the engine transfers, floor((L_in - 1) / block) blocks
(the decoder computes the last prompt token itself), times the KV bytes per token; over a link of
the given bandwidth it costs t_transfer, which the TTFT budget pays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict

from roofline.planner.cost_model import PlanInputs, decode_at, kv_budget, kv_bytes_per_token, kv_pool, prefill


@dataclass
class DisaggWorkload:
    input_len: int
    output_len: int
    request_rate: float  # requests per second
    ttft_slo_s: float
    tpot_slo_s: float
    link_bytes_per_s: float = 50e9  # the prefill -> decode fabric (InfiniBand HDR ~ 50 GB/s)

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if self.request_rate <= 0 or self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0 or self.link_bytes_per_s <= 0:
            raise ValueError("--request-rate, --ttft-slo, --tpot-slo and --kv-link-gbs must be positive")


def transferred_kv_bytes(p: PlanInputs, input_len: int) -> float:
    """KV bytes one request's prompt moves from the prefill to the decode engine: the blocks of every
    prompt token but the last (the decode engine computes that one), the last block partial but moved whole."""
    return -(-(input_len - 1) // p.block_size) * p.block_size * kv_bytes_per_token(p)


def prefill_rate_limit(t_prefill: float, t_transfer: float, ttft_slo: float) -> float:
    """Requests/s one prefill engine (M/D/1) sustains with mean TTFT within the SLO (0: never)."""
    a = (ttft_slo - t_transfer) / t_prefill - 1.0
    if a <= 0:
        return 0.0
    return (2 * a / (1 + 2 * a)) / t_prefill


def decode_batch_limit(p: PlanInputs, w: DisaggWorkload) -> Dict[str, Any]:
    """The largest decode batch within the TPOT SLO and the KV pool, and what bounds it."""
    live = w.input_len + w.output_len / 2
    pool = kv_pool(kv_budget(p)["kv_budget_bytes"], kv_bytes_per_token(p), p.block_size)
    by_kv = pool["kv_blocks"] // max(-(-(w.input_len + w.output_len) // p.block_size), 1)
    if decode_at(p, 1, live)["step_time_s"] > w.tpot_slo_s or by_kv < 1:
        return {"batch": 0, "bound": "tpot" if by_kv >= 1 else "kv", "kv_max_batch": by_kv}
    lo, hi = 1, max(by_kv, 1)  # largest b <= by_kv with step(b) <= SLO (the step time grows with b)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_at(p, mid, live)["step_time_s"] <= w.tpot_slo_s:
            lo = mid
        else:
            hi = mid - 1
    return {"batch": lo, "bound": "kv" if lo == by_kv else "tpot", "kv_max_batch": by_kv}


def plan_disagg(p: PlanInputs, w: DisaggWorkload) -> Dict[str, Any]:
    pre = prefill(replace(p, context=w.input_len), w.input_len)
    t_p = pre["prefill_s"]
    kv_bytes = transferred_kv_bytes(p, w.input_len)
    t_x = kv_bytes / w.link_bytes_per_s
    lam_p = prefill_rate_limit(t_p, t_x, w.ttft_slo_s)
    dec = decode_batch_limit(p, w)
    b = dec["batch"]
    step = decode_at(p, b, w.input_len + w.output_len / 2)["step_time_s"] if b else math.inf
    lam_d = b / (w.output_len * step) if b else 0.0
    n_p = math.ceil(w.request_rate / lam_p) if lam_p > 0 else None
    n_d = math.ceil(w.request_rate / lam_d) if lam_d > 0 else None
    feasible = n_p is not None and n_d is not None
    g = math.gcd(n_p, n_d) if feasible else 1
    return {
        "feasible": feasible,
        "why_not": None if feasible else ("prefill alone exceeds the TTFT SLO" if n_p is None
                                          else "one decode step exceeds the TPOT SLO, or one request's KV "
                                               "does not fit the pool"),
        "prefill_engines": n_p, "decode_engines": n_d,
        "ratio": f"{n_p // g}:{n_d // g}" if feasible else None,
        "prefill_s": t_p, "prefill_bound": pre["prefill_bound"],
        "prefill_max_rate_per_engine": lam_p,
        "prefill_utilization": w.request_rate * t_p / n_p if feasible else None,
        "kv_bytes_per_request": kv_bytes, "kv_transfer_s": t_x,
        "decode_batch": b, "decode_batch_bound": dec["bound"], "decode_kv_max_batch": dec["kv_max_batch"],
        "decode_step_s": step if b else None, "decode_max_rate_per_engine": lam_d,
        "workload": {"input_len": w.input_len, "output_len": w.output_len, "request_rate": w.request_rate,
                     "ttft_slo_s": w.ttft_slo_s, "tpot_slo_s": w.tpot_slo_s,
                     "kv_link_bytes_per_s": w.link_bytes_per_s},
    }


def render_disagg(d: Dict[str, Any], model: str, hardware: str) -> str:
    w = d["workload"]
    lines = [f"prefill/decode disaggregation: {model} on {hardware}",
             f"workload: {w['input_len']} in / {w['output_len']} out tokens at {w['request_rate']:g} req/s; "
             f"SLOs TTFT {w['ttft_slo_s'] * 1e3:g} ms, TPOT {w['tpot_slo_s'] * 1e3:g} ms"]
    if not d["feasible"]:
        lines.append(f"not feasible: {d['why_not']}")
    lines += [
        f"prefill: {d['prefill_s'] * 1e3:.2f} ms per prompt ({d['prefill_bound']}-bound); one engine sustains "
        f"{d['prefill_max_rate_per_engine']:.2f} req/s within the TTFT SLO (M/D/1 queue)",
        f"KV moved per request: {d['kv_bytes_per_request'] / 2**20:.2f} MiB, {d['kv_transfer_s'] * 1e3:.2f} ms "
        f"over {w['kv_link_bytes_per_s'] / 1e9:g} GB/s",
        f"decode: batch {d['decode_batch']} (bound by {d['decode_batch_bound']}; the KV pool holds "
        f"{d['decode_kv_max_batch']}), " + (f"{d['decode_step_s'] * 1e3:.2f} ms per step, " if d["decode_step_s"] else "")
        + f"one engine serves {d['decode_max_rate_per_engine']:.2f} req/s",
    ]
    if d["feasible"]:
        lines.append(f"engines: {d['prefill_engines']} prefill + {d['decode_engines']} decode "
                     f"(prefill:decode = {d['ratio']})")
    return "\n".join(lines)
