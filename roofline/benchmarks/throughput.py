"""`roofline bench throughput`: the offline workloads of BENCHMARKS.md.

W1  offline throughput (mixed lengths) and the prefill tokens/s of its prompts, optionally against HF
    transformers' static batches of 16, or with a fraction of the requests constrained by a JSON schema (--structured-fraction) against none,
    plus the schema's compile time, cold and cached
W3  shared prefix: throughput, mean TTFT and hit rate with prefix caching on and off
W4  long-prompt interference: ITL of 16 decoding requests while a 2048-token prompt is prefilled,
    with max_num_batched_tokens=256 and with chunking effectively off
W5  single-stream TPOT against the bandwidth bound (the weight bytes a greedy token streams / measured
    memory bandwidth), optionally against llama.cpp's batch-1 decode of the same GGUF file
W7  input-grounded single stream: median TPOT with and without speculative decoding, interleaved in
    one run, with the acceptance rate and mean acceptance length (--speculative-config, default ngram k=5)
W6  MoE + MLA (DeepSeek-V3 shape, small): W1's requests against HF static batches of 16, single-stream
    TPOT against the bytes a token reads (always-on weights + its routed experts + KV), and the KV tokens
    2 GiB holds with MLA against the same model with ordinary MHA (engine and planner)
W10 many adapters: W1's requests on the default model's architecture (dummy weights, HF format, fp32) with 4
    random rank-16 PEFT adapters on every projection assigned round robin, against the base model alone in
    the same engine; runs alternate --rounds times (medians), with the bytes one loaded adapter holds
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Optional

from roofline.benchmarks.datasets import random_requests, shared_prefix_requests
from roofline.entrypoints.engine_flags import add_engine_args, engine_args_from


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _make_llm(args, **overrides):
    from roofline.engine.llm import LLM

    ea = engine_args_from(args, **overrides)
    return LLM(**{k: v for k, v in vars(ea).items()}, show_progress=False)


def _make_engine(args, **overrides):
    """The engine itself (EngineCore), with the engine's and the server's defaults: the ITL-driven token budget
    on unless --target-itl-ms 0 (the offline LLM class turns it off by default), for a workload that streams."""
    from roofline.engine.engine_core import EngineCore

    return EngineCore.from_engine_args(engine_args_from(args, **overrides), show_progress=False)


def _vocab(llm) -> int:
    return int(llm.llm_engine.model_config.hf_config.vocab_size)


def _warmup(llm) -> None:
    from roofline import SamplingParams

    llm.generate([{"prompt_token_ids": [100 + i for i in range(16)]}] * 2,
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)


def _step_records(llm) -> list:
    """The engine's live-roofline step records since the previous call (empty with --no-step-roofline)."""
    return llm.llm_engine.get_stats().step_roofline


def _live_roofline(records: list) -> Any:
    """Per-phase median step-vs-bound ratio of a run's steps (metrics/step_roofline.py), or "off"."""
    from roofline.metrics.step_roofline import phase_medians

    return phase_medians(records) if records else "off (--no-step-roofline)"


def _spec_counts(llm):
    """The engine's speculative decoding counters (a copy), None when speculation is off."""
    spec = llm.llm_engine.get_stats().spec_decode
    return spec.copy() if spec is not None else None


def _spec_summary(after, before) -> dict[str, Any]:
    """Acceptance of a run: draft tokens accepted / proposed, and tokens per verifying step."""
    d = after.minus(before) if before is not None else after
    return {"acceptance_rate": d.acceptance_rate, "mean_acceptance_length": d.mean_acceptance_length,
            "num_drafts": d.num_drafts, "num_draft_tokens": d.num_draft_tokens,
            "num_accepted_tokens": d.num_accepted_tokens}


def _run_offline(llm, reqs, constraints: Optional[dict] = None, lora_requests: Optional[list] = None) -> dict[str, Any]:
    """constraints: request index -> StructuredOutputsParams for the constrained ones; lora_requests: each
    request's LoRA adapter (None: the base model)."""
    from roofline import SamplingParams

    constraints = constraints or {}
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True,
                             structured_outputs=constraints.get(i)) for i, r in enumerate(reqs)]
    _step_records(llm)
    spec_before = _spec_counts(llm)
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    dt = time.monotonic() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(r.prompt) for r in reqs)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    res = {"seconds": dt, "output_tokens": n_out, "prompt_tokens": n_in,
           "output_tok_s": n_out / dt, "total_tok_s": (n_out + n_in) / dt,
           "live_roofline": _live_roofline(_step_records(llm)),
           "mean_ttft_s": statistics.mean(ttfts), "outputs": outs}
    spec_after = _spec_counts(llm)
    if spec_after is not None:
        res["speculative"] = _spec_summary(spec_after, spec_before)
    return res


# ---- W1 ---------------------------------------------------------------------------------------
def hf_static_batches(model_path: Optional[str], reqs, batch_size: int = 16, dtype: str = "float32") -> dict:
    """HF transformers generate in static batches (left-padded, each batch runs to its longest output)."""
    import torch
    from transformers import AutoModelForCausalLM

    from roofline.model_executor.loader.source import resolve_source

    src = resolve_source(model_path, "auto")
    torch_dtype = getattr(torch, dtype)
    if src.fmt == "gguf":
        model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch_dtype)
    return hf_generate_static(model, reqs, batch_size)


def hf_generate_static(model, reqs, batch_size: int = 16) -> dict:
    """Time HF `generate` over reqs in static batches of batch_size (the model is released afterwards)."""
    import torch

    model.eval()
    pad = 0
    warm = torch.tensor([[100 + i for i in range(16)]])
    with torch.no_grad():
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False, pad_token_id=pad)
    t0 = time.monotonic()
    useful = 0
    with torch.no_grad():
        for i in range(0, len(reqs), batch_size):
            batch = reqs[i : i + batch_size]
            longest = max(len(r.prompt) for r in batch)
            ids = torch.full((len(batch), longest), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):
                ids[j, longest - len(r.prompt) :] = torch.tensor(r.prompt)
                mask[j, longest - len(r.prompt) :] = 1
            new = max(r.output_len for r in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad)
            useful += sum(r.output_len for r in batch)
    dt = time.monotonic() - t0
    del model
    gc.collect()
    return {"seconds": dt, "output_tokens": useful, "output_tok_s": useful / dt}


# A record schema with an open-ended array, so a constrained request stays constrained for a while
# (past the closing brace only EOS is allowed; ignore_eos then lets it run on, unconstrained).
W1_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "active": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["id", "name", "active", "tags"]}


def structured_compile_times(llm, repeats: int = 200) -> dict[str, float]:
    """W1_SCHEMA's compile: the first one (the tokenizer's tables built beforehand) and cached look-ups."""
    from roofline.sampling_params import StructuredOutputsParams

    cache = llm.llm_engine.structured_output.cache
    t0 = time.perf_counter()
    cache.compile(StructuredOutputsParams(regex="[0-9]"))  # builds the tokenizer info (once per engine)
    first_use = time.perf_counter() - t0
    schema = StructuredOutputsParams(json=W1_SCHEMA)
    t0 = time.perf_counter()
    cache.compile(schema)
    cold = time.perf_counter() - t0
    cached = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        cache.compile(StructuredOutputsParams(json=W1_SCHEMA))  # a fresh params object, same schema
        cached.append(time.perf_counter() - t0)
    return {"tokenizer_info_ms": 1000 * first_use, "schema_cold_ms": 1000 * cold,
            "schema_cached_us_median": 1e6 * statistics.median(cached)}


def w1_requests(args, vocab_size: int) -> list:
    """W1's requests (BENCHMARKS.md: 64, in 64..256, out 32..256, seed 0), --num-requests of them, each
    output cut to --max-output-tokens where given (a scaled-down run: the same prompts, shorter answers)."""
    reqs = random_requests(args.num_requests, (64, 256), (32, 256), seed=0, vocab_size=vocab_size)
    cap = getattr(args, "max_output_tokens", None)
    if cap is not None:
        reqs = [replace(r, output_len=min(r.output_len, cap)) for r in reqs]
    return reqs


def w1(args) -> dict:
    llm = _make_llm(args)
    reqs = w1_requests(args, _vocab(llm))
    _warmup(llm)
    pp = llm.llm_engine.config.parallel_config.pipeline_parallel_size
    if pp > 1:
        llm.llm_engine.executor.reset_stage_busy()
    res = _run_offline(llm, reqs)
    outs = res.pop("outputs")
    out = {"workload": "W1", "num_requests": args.num_requests,
           "quantized_weights": llm.llm_engine.config.model_config.quantized_weights, "roofline": res}
    if pp > 1:  # each rank's idle share of the run against the planner's (pp - 1) / (m + pp - 1), m = pp in flight
        from roofline.planner.cost_model import pp_bubble_fraction

        busy = llm.llm_engine.executor.stage_busy()
        out["pipeline_bubble_per_rank"] = [round(1 - b / w, 3) if w else None for b, w in busy]
        out["pipeline_bubble_planner"] = pp_bubble_fraction(pp, pp)
    out["prefill"] = prefill_throughput(llm, reqs)
    if args.speculative_config is not None:  # the same requests with speculation off, same greedy tokens
        del llm  # one engine at a time
        gc.collect()
        llm = base_llm = _make_llm(args, speculative_config=None)
        _warmup(base_llm)
        off = _run_offline(base_llm, reqs)
        off_outs = off.pop("outputs")
        off["same_tokens"] = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, off_outs))
        out["speculation_off"] = off
        out["ratio_spec_on_off_tok_s"] = res["output_tok_s"] / off["output_tok_s"]
        del base_llm
    if args.structured_fraction > 0:
        from roofline.sampling_params import StructuredOutputsParams

        out["compile"] = structured_compile_times(llm)
        every = max(1, round(1 / args.structured_fraction))
        constraints = {i: StructuredOutputsParams(json=W1_SCHEMA) for i in range(0, len(reqs), every)}
        # the same prompts again: without this the second run would find them all in the prefix cache
        llm.llm_engine.scheduler.reset_prefix_cache()
        sres = _run_offline(llm, reqs, constraints)
        outs = sres.pop("outputs")
        sres["constrained_requests"] = len(constraints)
        eos = llm.llm_engine.eos_token_id  # the grammar's end: only EOS is allowed there, the rest runs free
        sres["constrained_tokens"] = sum(ids.index(eos) + 1 if eos in ids else len(ids)
                                         for ids in (outs[i].outputs[0].token_ids for i in constraints))
        out["structured"] = sres
        out["structured_ratio_tok_s"] = sres["output_tok_s"] / res["output_tok_s"]
    if args.compare_hf:
        del llm
        gc.collect()
        hf = hf_static_batches(args.model, reqs, 16, "float32" if args.dtype in ("auto", "float32") else args.dtype)
        out["hf_static_batch16"] = hf
        out["ratio_output_tok_s"] = res["output_tok_s"] / hf["output_tok_s"]
    return out


def prefill_throughput(llm, reqs) -> dict:
    """The same prompts prefilled alone (one output token each, the prefix cache emptied first): prompt
    tokens/s of the engine's prefill steps."""
    from roofline import SamplingParams

    llm.llm_engine.scheduler.reset_prefix_cache()
    t0 = time.monotonic()
    llm.generate([{"prompt_token_ids": r.prompt} for r in reqs], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    dt = time.monotonic() - t0
    n_in = sum(len(r.prompt) for r in reqs)
    return {"seconds": dt, "prompt_tokens": n_in, "prompt_tok_s": n_in / dt}


# ---- W3 ---------------------------------------------------------------------------------------
def w3(args) -> dict:
    out: dict[str, Any] = {"workload": "W3"}
    for caching in (True, False):
        llm = _make_llm(args, enable_prefix_caching=caching)
        reqs = shared_prefix_requests(64, 512, 32, 32, seed=1, vocab_size=_vocab(llm))
        _warmup(llm)
        before = llm.llm_engine.get_stats()
        res = _run_offline(llm, reqs)
        res.pop("outputs")
        after = llm.llm_engine.get_stats()
        q = after.prefix_cache_queries - before.prefix_cache_queries
        h = after.prefix_cache_hits - before.prefix_cache_hits
        res["hit_rate"] = h / q if q else 0.0
        out["caching_on" if caching else "caching_off"] = res
        del llm
        gc.collect()
    out["ttft_ratio_on_over_off"] = out["caching_on"]["mean_ttft_s"] / out["caching_off"]["mean_ttft_s"]
    return out


# ---- W4 ---------------------------------------------------------------------------------------
def _w4_run(args, budget: Optional[int]) -> dict:
    """One engine: the decoders' ITLs before the long prompt arrives (once every decoder is past its first
    interval: steady decode steps) and while it prefills.  budget: a fixed max_num_batched_tokens with the
    ITL-driven token budget off (None: the default configuration, the budget on)."""
    from roofline import SamplingParams

    engine = _make_engine(args, **({} if budget is None else {"max_num_batched_tokens": budget, "target_itl_ms": 0}))
    vocab = int(engine.model_config.hf_config.vocab_size)
    for i in range(2):  # warm-up, as _warmup's
        engine.add_request(f"warmup{i}", [100 + j for j in range(16)],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    decoders = random_requests(16, (64, 64), (256, 256), seed=0, vocab_size=vocab)
    long_req = random_requests(1, (2048, 2048), (16, 16), seed=1, vocab_size=vocab)[0]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    from roofline.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.DELTA
    for i, r in enumerate(decoders):
        engine.add_request(f"d{i}", r.prompt, params)
    last_token_at: dict[str, float] = {}
    counts = {f"d{i}": 0 for i in range(16)}
    itl_window: list[float] = []
    itl_before: list[float] = []  # pure decode steps, before the long prompt arrives
    long_added = long_first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.monotonic()
        for o in outs:
            rid = o.request_id
            if rid == "long":
                if long_first is None and o.outputs and o.outputs[0].token_ids:
                    long_first = now
                continue
            n = sum(len(c.token_ids) for c in o.outputs)
            if n == 0:
                continue
            if rid in last_token_at and long_added is not None and long_first is None:
                itl_window.append(now - last_token_at[rid])
            elif rid in last_token_at and long_added is None and min(counts.values()) >= 2:
                itl_before.append(now - last_token_at[rid])
            last_token_at[rid] = now
            counts[rid] += n
        if long_added is None and all(c >= 32 for c in counts.values()):
            lp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            lp.output_kind = RequestOutputKind.DELTA
            engine.add_request("long", long_req.prompt, lp)
            long_added = time.monotonic()
    p99, p99_before = _percentile(itl_window, 0.99), _percentile(itl_before, 0.99)
    res = {"max_num_batched_tokens": engine.config.scheduler_config.max_num_batched_tokens,
           "target_itl_ms": engine.config.scheduler_config.target_itl_ms,
           "p99_itl_ms": 1000 * p99, "max_itl_ms": 1000 * max(itl_window or [float("nan")]),
           "p99_itl_before_ms": 1000 * p99_before, "p99_during_over_before": p99 / p99_before,
           "ttft_long_s": (long_first - long_added) if long_first and long_added else float("nan"),
           "itl_samples": len(itl_window)}
    del engine
    gc.collect()
    return res


def w4(args) -> dict:
    """The default configuration (its ITL-driven token budget), a fixed 256-token budget, and chunking
    effectively off; each with the decoders' p99 ITL while the long prompt prefills over their p99 before."""
    default = _w4_run(args, None)
    chunked = _w4_run(args, 256)
    unchunked = _w4_run(args, 4096)
    return {"workload": "W4", "default": default, "chunked_256": chunked, "unchunked": unchunked,
            "p99_itl_ratio": chunked["p99_itl_ms"] / unchunked["p99_itl_ms"]}


# ---- W5 ---------------------------------------------------------------------------------------
def weight_bytes(model) -> int:
    """The model's weight bytes as its layers compute on them (GGUF blocks where kept; tied ones once)."""
    from roofline.model_executor.layers.quantization import weight_bytes_by_format

    return sum(weight_bytes_by_format(model).values())


def token_bytes(model) -> int:
    """Weight bytes one greedy single-stream decode token streams (W5's bound): weight_bytes, with the LM
    head read through its int8 screen where greedy rows use one (greedy_head.py)."""
    total = weight_bytes(model)
    head = getattr(model, "lm_head", None)
    screen = getattr(head, "cpu_greedy", None)
    if screen is not None:
        total += sum(t.numel() * t.element_size() for t in (screen.panels, screen.scales, screen.bound_w,
                                                             screen.bound_q))
        total -= head.weight.numel() * head.weight.element_size()
    return total


def w5(args) -> dict:
    from roofline import SamplingParams
    from roofline.planner.probes import measure_bandwidth

    llm = _make_llm(args)
    _warmup(llm)
    req = random_requests(1, (128, 128), (256, 256), seed=0, vocab_size=_vocab(llm))[0]
    _step_records(llm)
    out = llm.generate({"prompt_token_ids": req.prompt}, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    tpot = (m.finished_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1)
    steps = _step_records(llm)
    worker = llm.llm_engine.executor.worker
    tb = token_bytes(worker.model)
    bw = measure_bandwidth(str(worker.device))  # same run, same machine
    bound = tb / bw
    res = {"workload": "W5", "quantized_weights": llm.llm_engine.config.model_config.quantized_weights,
           "tpot_ms": 1000 * tpot, "decode_tok_s": 1 / tpot,
           "prefill_tok_s": len(req.prompt) / (m.first_token_time - m.first_scheduled_time),
           "weight_bytes": dict(worker.weight_bytes), "token_bytes": tb,
           "bandwidth_gb_s": bw / 1e9, "bound_ms": 1000 * bound, "ratio": tpot / bound,
           "live_roofline": _live_roofline(steps)}
    if args.compare_llamacpp:
        res["llamacpp"] = llamacpp_peer(args, req.prompt, 256)
        res["ratio_decode_tok_s_vs_llamacpp"] = res["decode_tok_s"] / res["llamacpp"]["decode_tok_s"]
        res["ratio_decode_tok_s_vs_llamacpp_eval_only"] = res["decode_tok_s"] / res["llamacpp"]["eval_only_tok_s"]
    return res


def llamacpp_peer(args, prompt: list[int], n_out: int) -> dict:
    """llama.cpp on the same GGUF file, prompt and thread count (llamacpp_peer.py, run by the
    --compare-llamacpp interpreter, where llama-cpp-python is installed)."""
    import os
    import subprocess

    import torch

    from roofline.model_executor.loader.source import resolve_source

    src = resolve_source(args.model, args.load_format)
    if src.fmt != "gguf":
        raise SystemExit("--compare-llamacpp needs a GGUF model (the default one is)")
    script = os.path.join(os.path.dirname(__file__), "llamacpp_peer.py")
    r = subprocess.run([args.compare_llamacpp, script, os.path.join(src.path, src.gguf_file),
                        str(torch.get_num_threads()), str(n_out), json.dumps(prompt)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"the llama.cpp peer failed: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- W6 ---------------------------------------------------------------------------------------
W6_CONFIG = dict(vocab_size=49152, hidden_size=1024, num_hidden_layers=8, first_k_dense_replace=1,
                 intermediate_size=2816, moe_intermediate_size=256, n_routed_experts=64, num_experts_per_tok=6,
                 n_shared_experts=2, n_group=8, topk_group=4, routed_scaling_factor=2.5, num_attention_heads=16,
                 num_key_value_heads=16, kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=32,
                 qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=4096)
KV_COMPARE_BYTES = 2 << 30
W6_RUN_KV_BYTES = 512 << 20  # the run's pool: 58k tokens, W6's 64 requests hold at most 33k at once


def token_read_bytes(model, context: int, dtype_bytes: int) -> dict:
    """Bytes one decoded token reads at `context`: every weight but the input embedding (one row of it),
    of each MoE layer only the k of E experts it routes to, and the KV cache of its context."""
    from roofline.model_executor.layers.moe import FusedMoE

    experts = routed = 0.0
    for m in model.modules():
        if isinstance(m, FusedMoE):
            size = sum(t.numel() * t.element_size() for t in m.expert_stacks())  # dense, or FP8 bytes + scales
            experts += size
            routed += size * m.routing.top_k / m.num_experts
    embed = model.model.embed_tokens.weight
    embed_bytes = 0 if getattr(model, "tie_word_embeddings", False) else embed.numel() * embed.element_size()
    always = weight_bytes(model) - embed_bytes - experts
    kv = context * sum(s.values_per_token for s in model.kv_cache_specs()) * dtype_bytes
    return {"always_on_weight_bytes": always, "routed_expert_bytes": routed, "kv_bytes": kv,
            "total": always + routed + kv}


def kv_capacity_2gib(hf_config: dict, engine_tokens: int, block_size: int) -> dict:
    """KV tokens 2 GiB holds: MLA as the engine allocated it and as the planner predicts, and the same
    model with ordinary MHA (K and V of every head, head size qk_nope + qk_rope) as the planner and
    the engine's own sizing (kv_spec) give it."""
    import dataclasses

    import torch

    from roofline.attention import kv_spec
    from roofline.planner.cost_model import kv_pool
    from roofline.planner.model_specs import ModelSpec

    spec = ModelSpec.from_hf_config(hf_config)
    mha = dataclasses.replace(spec, kv_lora_rank=0, num_kv_heads=spec.num_heads)
    mha_specs = [kv_spec.attention_spec(mha.num_kv_heads, mha.head_dim)] * spec.num_layers
    mha_engine = KV_COMPARE_BYTES // kv_spec.bytes_per_block(mha_specs, block_size, torch.float32) * block_size
    return {
        "budget_bytes": KV_COMPARE_BYTES,
        "mla_engine_tokens": engine_tokens,
        "mla_planner_tokens": kv_pool(KV_COMPARE_BYTES, spec.kv_bytes_per_token(4), block_size)["kv_tokens"],
        "mha_engine_sizing_tokens": mha_engine,
        "mha_planner_tokens": kv_pool(KV_COMPARE_BYTES, mha.kv_bytes_per_token(4), block_size)["kv_tokens"],
        "mla_bytes_per_token": spec.kv_bytes_per_token(4),
        "mha_bytes_per_token": mha.kv_bytes_per_token(4),
    }


def w6(args) -> dict:
    """MoE + MLA (DeepSeek-V3 shape, small), dummy weights: throughput vs HF static batches of 16,
    single-stream TPOT vs the bytes a token reads, KV tokens in 2 GiB for MLA vs MHA."""
    import os
    import tempfile

    from roofline import SamplingParams
    from roofline.planner.probes import measure_bandwidth

    from transformers import DeepseekV3Config

    hf_cfg = DeepseekV3Config(**W6_CONFIG)
    config = dict(hf_cfg.to_dict(), architectures=["DeepseekV3ForCausalLM"])
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        # the run needs < 0.5 GiB of KV; the 2 GiB figure is the engine's own sizing (determine_num_blocks)
        llm = _make_llm(args, model=tmp, load_format="dummy", dtype="float32", kv_cache_memory=W6_RUN_KV_BYTES)
        engine = llm.llm_engine
        reqs = random_requests(64, (64, 256), (32, 256), seed=0, vocab_size=_vocab(llm))
        _warmup(llm)
        res = _run_offline(llm, reqs)
        res.pop("outputs")
        # single stream, W5's shape: 128-token prompt, 256 tokens out
        one = random_requests(1, (128, 128), (256, 256), seed=0, vocab_size=_vocab(llm))[0]
        out = llm.generate({"prompt_token_ids": one.prompt},
                           SamplingParams(temperature=0, max_tokens=256, ignore_eos=True), use_tqdm=False)[0]
        m = out.metrics
        tpot = (m.finished_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1)
        worker = engine.executor.worker
        reads = token_read_bytes(worker.model, 128 + 128, 4)  # the mean context of the decode
        bw = measure_bandwidth(str(worker.device))
        block_size = engine.config.cache_config.block_size
        kv = kv_capacity_2gib(config, KV_COMPARE_BYTES // worker.block_bytes() * block_size, block_size)
        del llm, engine, worker
        gc.collect()
    result = {"workload": "W6", "roofline": res,
              "single_stream": {"tpot_ms": 1000 * tpot, **reads, "bandwidth_gb_s": bw / 1e9,
                                "bound_ms": 1000 * reads["total"] / bw, "ratio": tpot * bw / reads["total"]},
              "kv_tokens_2gib": kv}
    print(json.dumps(result), file=sys.stderr, flush=True)  # ours, before the (long) HF peer run
    if args.compare_hf:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        hf = hf_generate_static(AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32), reqs, 16)
        result["hf_static_batch16"] = hf
        result["ratio_output_tok_s"] = res["output_tok_s"] / hf["output_tok_s"]
    return result


# ---- W7 ---------------------------------------------------------------------------------------
W7_MODULES = ("json", "textwrap", "heapq", "bisect")
W7_DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 5}
W7_KV_BYTES = 64 << 20  # 4 prompts of ~700 tokens, one at a time: two engines side by side stay small


def w7_prompts() -> list[str]:
    """Each module's source, first 900 characters, twice (a blank line between), then its first 150."""
    import importlib
    import inspect

    out = []
    for name in W7_MODULES:
        doc = inspect.getsource(importlib.import_module(name))[:900]
        out.append(doc + "\n\n" + doc + "\n\n" + doc[:150])
    return out


def _tpot(output) -> float:
    m = output.metrics
    return (m.finished_time - m.first_token_time) / (len(output.outputs[0].token_ids) - 1)


def w7(args) -> dict:
    from roofline import SamplingParams

    spec_config = args.speculative_config or W7_DEFAULT_SPEC
    kv = args.kv_cache_memory or W7_KV_BYTES
    on = _make_llm(args, speculative_config=spec_config, kv_cache_memory=kv)
    off = _make_llm(args, speculative_config=None, kv_cache_memory=kv)
    for llm in (on, off):
        _warmup(llm)
    sp = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    tpots: dict[str, list[float]] = {"on": [], "off": []}
    same = True
    before = _spec_counts(on)
    # interleaved, args.rounds times over the prompts, the order flipping each round (a shared machine's
    # slow spells then hit both sides alike)
    for r in range(args.rounds):
        for prompt in w7_prompts():
            pair = {}
            for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
                pair[side] = (off if side == "off" else on).generate([prompt], sp, use_tqdm=False)[0]
                tpots[side].append(_tpot(pair[side]))
            same = same and pair["off"].outputs[0].token_ids == pair["on"].outputs[0].token_ids
    off_ms, on_ms = 1000 * statistics.median(tpots["off"]), 1000 * statistics.median(tpots["on"])
    return {"workload": "W7", "speculative_config": json.dumps(spec_config),
            "tpot_ms_off_median": off_ms, "tpot_ms_on_median": on_ms, "speedup": off_ms / on_ms,
            "same_tokens": same, "speculative": _spec_summary(_spec_counts(on), before),
            "tpot_ms_off": ", ".join(f"{1000 * t:.1f}" for t in tpots["off"]),
            "tpot_ms_on": ", ".join(f"{1000 * t:.1f}" for t in tpots["on"])}


# ---- W10 --------------------------------------------------------------------------------------
W10_ADAPTERS, W10_RANK = 4, 16


def w10(args) -> dict:
    """Many adapters (BENCHMARKS.md W10): output tok/s with 4 adapters assigned round robin / without."""
    import os
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from roofline import LoRARequest, SamplingParams
    from roofline.lora.peft import LLAMA_TARGETS, write_random_adapter
    from roofline.model_executor.loader.source import load_hf_config, resolve_source

    with tempfile.TemporaryDirectory() as tmp:
        load_hf_config(resolve_source(None)).save_pretrained(tmp)  # the default model's config, HF format
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp))
        adapters, adapter_bytes = [], 0
        for i in range(W10_ADAPTERS):
            path = os.path.join(tmp, f"adapter{i}")
            weights = write_random_adapter(path, meta, W10_RANK, 2 * W10_RANK, LLAMA_TARGETS, seed=i, std=0.01)
            adapter_bytes = sum(a.numel() + b.numel() for a, b in weights.values()) * 4  # fp32 A and B
            adapters.append(LoRARequest(f"adapter{i}", i + 1, path))
        llm = _make_llm(args, model=tmp, load_format="dummy", dtype="float32", enable_lora=True,
                        max_loras=W10_ADAPTERS, max_lora_rank=W10_RANK)
        reqs = w1_requests(args, _vocab(llm))
        assigned = [adapters[i % W10_ADAPTERS] for i in range(len(reqs))]
        llm.generate([{"prompt_token_ids": r.prompt} for r in reqs[:W10_ADAPTERS]],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False,
                     lora_request=adapters)  # warm-up: every adapter loaded and in a slot
        runs: dict[str, list[float]] = {"base": [], "adapters": []}
        for _ in range(max(1, args.rounds)):
            for mode in runs:
                res = _run_offline(llm, reqs, lora_requests=assigned if mode == "adapters" else None)
                runs[mode].append(res["output_tok_s"])
        del llm
        gc.collect()
    base, lora = statistics.median(runs["base"]), statistics.median(runs["adapters"])
    return {"workload": "W10", "adapters": W10_ADAPTERS, "rank": W10_RANK, "rounds": max(1, args.rounds),
            "base_output_tok_s": base, "adapters_output_tok_s": lora, "ratio_output_tok_s": lora / base,
            "base_runs_tok_s": runs["base"], "adapter_runs_tok_s": runs["adapters"],
            "bytes_per_adapter": adapter_bytes}


WORKLOADS = {"w1": w1, "w3": w3, "w4": w4, "w5": w5, "w6": w6, "w7": w7, "w10": w10}


def _fmt(d: dict, indent: int = 0) -> str:
    lines = []
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(" " * indent + f"{k}:")
            lines.append(_fmt(v, indent + 2))
        elif isinstance(v, float):
            lines.append(" " * indent + f"{k:<28}{v:.4g}")
        else:
            lines.append(" " * indent + f"{k:<28}{v}")
    return "\n".join(lines)


def _live_lines(d: dict, where: str = "") -> list:
    """(path, one-line summary) for every live_roofline summary in a result."""
    from roofline.metrics.step_roofline import format_phase_medians

    out = []
    for k, v in d.items():
        if k == "live_roofline" and isinstance(v, dict):
            out.append((where or d.get("workload", ""), format_phase_medians(v)))
        elif isinstance(v, dict):
            out.extend(_live_lines(v, f"{where}/{k}" if where else k))
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    results = [WORKLOADS[n](args) for n in names]
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=2))
    else:
        for r in results:
            print(_fmt(r))
            for where, live in _live_lines(r):
                print(f"{where}: {live}")
            print()
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("throughput", help="offline workloads W1, W3-W7, W10 (BENCHMARKS.md)")
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="w1")
    p.add_argument("--compare-hf", action="store_true", help="W1, W6: also run HF transformers static batches of 16")
    p.add_argument("--structured-fraction", type=float, default=0.0,
                   help="W1: also run with this fraction of the requests (every round(1/f)-th) constrained by a "
                        "JSON schema, and time the schema's compile (cold, cached)")
    p.add_argument("--compare-llamacpp", metavar="PYTHON", default=None,
                   help="W5: also run llama.cpp on the same GGUF file and threads through this interpreter, which "
                        "has llama-cpp-python installed (a benchmark peer, not a dependency)")
    p.add_argument("--num-requests", type=int, default=64,
                   help="W1, W10: requests (64 in BENCHMARKS.md; fewer for a scaled-down run, same generator)")
    p.add_argument("--max-output-tokens", type=_positive_int, default=None,
                   help="W1, W10: cut each request's output to this many tokens (a scaled-down run; same prompts)")
    p.add_argument("--rounds", type=int, default=1,
                   help="W7: passes over the 4 prompts (order flips each pass); W10: alternating runs of each mode")
    p.add_argument("--json", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_engine_args(p)
    p.set_defaults(func=run)
