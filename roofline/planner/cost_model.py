"""The serving cost model of the seeds, as code.

Memory (per GPU, after the tensor-parallel split)::

    weights      W_mem = total_params * weight_bytes / tp
    KV budget    M_kv  = memory * gpu_memory_utilization - W_mem - activation_reserve
                 (or exactly --kv-budget-gib when given)
    KV pool      blocks = floor(M_kv / (block_size * K_tok)),  tokens = blocks * block_size

Capacity::

    max_seqs_at_context = floor(blocks / ceil(context / block_size))      fully-grown, paged
    naive_max_seqs      = floor(M_kv / (context * K_tok))                 contiguous reservation
    paged_max_seqs      = floor(blocks / ceil(avg_context / block_size))  paged, average length

Time of one decode step for `b` sequences of average context `S` (the roofline)::

    bytes = W_read(b) + b * S * K_tok          (weights once per step, every sequence its own KV)
    flops = b * (2 * active_params + attention_flops(S)) / tp
    T     = max(bytes / BW, flops / F_peak) + overhead

The seeds write the memory-bound branch, `T ~ (W + b*K(S)) / B_HBM`; `max` adds the compute roof so
that very large batches (and slow-FLOP devices such as a CPU) are handled too. `overhead` is zero
for the datasheet presets; `--measure` fills it with a measured per-step framework cost.

    intensity  I = flops / bytes;   ridge R = F_peak / BW
    saturation b* : the batch where the KV term equals the weight term, W_read(b*) = b* * S * K_tok
    prefill(S)    : max((2*active*S + causal attention) / F_peak, (W_read(S) + S*K_tok) / BW)

Pipeline parallelism (`pp` stages of layers, the split of distributed/layout.py)::

    stage weights   W_s = layers_s * W_layer / tp  (+ embedding on the first, + LM head on the last)
    stage KV/token  K_s = K_tok * layers_s / L;   the pool holds min over stages of its blocks
    bubble          (pp - 1) / (m + pp - 1)   for m batches in the pipeline per flush (GPipe)
    between stages  2 * tokens * d * act_bytes per step (hidden states and residual)
    decode          each stage runs its share of the step on b/m sequences; a round of the m batches
                    takes (m + pp - 1) stage steps

The seeds' worked numbers use round inputs (e.g. "40 GB / 5 MB = 8000 blocks", "320 KB/token");
this module is exact for the inputs it is given, so tests reproduce the seeds' answers with the
seeds' inputs to within the rounding the seeds themselves do (tolerances are stated per test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from roofline.planner.hardware import DTYPE_BYTES, HardwareSpec, normalize_dtype
from roofline.planner.model_specs import ModelSpec


@dataclass
class PlanInputs:
    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    dp: int = 1  # data-parallel replicas (expert parallelism spans dp x tp)
    expert_parallel: bool = False  # routed experts spread whole over the dp x tp ranks
    num_redundant_experts: int = 0  # EPLB's extra replicas per MoE layer
    weight_dtype: Optional[str] = None  # default: the checkpoint's native dtype
    kv_dtype: Optional[str] = None  # default: the weights' dtype (bf16 for fp8 weights)
    gpu_memory_utilization: float = 0.9
    kv_budget_bytes: Optional[float] = None  # overrides the utilization-based budget
    block_size: int = 16
    context: int = 4096  # max_model_len: what a naive allocator reserves per sequence
    avg_context: Optional[int] = None  # average live context of running sequences (default: context)
    batch: int = 32
    max_num_batched_tokens: int = 2048  # prefill chunk, for the activation reserve estimate
    max_num_seqs: int = 256
    step_overhead_s: float = 0.0  # fixed per-step cost (framework, launches); 0 for datasheet plans
    pp: int = 1  # pipeline stages
    pp_layer_partition: Optional[List[int]] = None  # layers per stage (default: the engine's even split)
    microbatches: Optional[int] = None  # batches in the pipeline at once (default: pp)

    def __post_init__(self):
        self.weight_dtype = normalize_dtype(self.weight_dtype or self.model.native_dtype)
        if self.kv_dtype is None:  # the activation dtype: fp8 weights still compute (and cache) in bf16
            self.kv_dtype = self.weight_dtype if self.weight_dtype in ("fp32", "fp16") else "bf16"
        self.kv_dtype = normalize_dtype(self.kv_dtype)
        if self.avg_context is None:
            self.avg_context = self.context
        if self.dp < 1 or self.num_redundant_experts < 0:
            raise ValueError("dp must be >= 1 and num_redundant_experts >= 0")
        if self.expert_parallel and self.model.is_moe:
            ep = self.dp * self.tp
            if (self.model.num_experts + self.num_redundant_experts) % ep:
                raise ValueError(f"{self.model.num_experts} experts + {self.num_redundant_experts} redundant do not "
                                 f"split evenly over {ep} expert-parallel ranks (dp x tp)")
        if self.tp < 1 or self.block_size < 1 or self.batch < 1 or self.context < 1 or self.avg_context < 1:
            raise ValueError("tp, block size, batch, context and avg context must all be >= 1")
        if self.microbatches is None:
            self.microbatches = self.pp
        if self.pp < 1 or self.microbatches < 1:
            raise ValueError("pp and microbatches must be >= 1")

    @property
    def weight_bytes(self) -> float:
        """Bytes per weight: the dtype's, plus an FP8 block checkpoint's fp32 scale shared by a block."""
        extra = 4.0 / self.model.weight_block_elems if self.weight_dtype == "fp8" and self.model.weight_block_elems else 0.0
        return DTYPE_BYTES[self.weight_dtype] + extra

    @property
    def kv_bytes(self) -> float:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def peak_flops(self) -> float:
        return self.hardware.flops_for(self.weight_dtype)


# ---------------------------------------------------------------------------------------------
# Pieces (usable on their own, as the tests do with the seeds' explicit inputs)
# ---------------------------------------------------------------------------------------------

def kv_pool(kv_budget_bytes: float, kv_bytes_per_token: float, block_size: int) -> Dict[str, int]:
    """Blocks and tokens a KV budget holds (deep-dive-08 section 5.1, exercise 1)."""
    block_bytes = block_size * kv_bytes_per_token
    blocks = int(kv_budget_bytes // block_bytes) if block_bytes > 0 else 0
    return {"kv_block_bytes": block_bytes, "kv_blocks": max(blocks, 0), "kv_tokens": max(blocks, 0) * block_size}


def max_request_tokens(model, kv_budget_bytes: float, block_size: int, kv_dtype_bytes: float, tp: int = 1) -> int:
    """The longest single request a KV budget holds at every step of its life (sliding layers counting their
    window's blocks only): request_kv_bytes peaks at each block's first token and those peaks grow with the
    block index (the hybrid KV manager's capacity_tokens, in bytes)."""
    def fits(k: int) -> bool:  # block k's first token
        return model.request_kv_bytes(k * block_size + 1, block_size, kv_dtype_bytes, tp) <= kv_budget_bytes

    if not fits(0):
        return 0
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, 2 * hi
    while lo < hi - 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return (lo + 1) * block_size


def blocks_per_seq(context: int, block_size: int) -> int:
    return -(-int(context) // int(block_size))


def naive_capacity(kv_budget_bytes: float, kv_bytes_per_token: float, context: int) -> int:
    """Sequences that fit when each reserves `context` tokens of contiguous KV (exercise 4, naive)."""
    return max(int(kv_budget_bytes // (context * kv_bytes_per_token)), 0)


def paged_capacity(num_blocks: int, context: int, block_size: int) -> int:
    """Sequences of length `context` that fit in a pool of `num_blocks` blocks (exercise 4, paged)."""
    return num_blocks // blocks_per_seq(context, block_size)


def decode_step_time(weight_bytes_read: float, kv_bytes_per_token: float, batch: float, context: float,
                     bandwidth: float, flops: float = 0.0, peak_flops: float = math.inf,
                     overhead_s: float = 0.0) -> Dict[str, float]:
    """The roofline step time: max(memory time, compute time) + overhead (deep-dive-08 section 1.3, 2.4)."""
    kv_read = batch * context * kv_bytes_per_token
    total = weight_bytes_read + kv_read
    t_mem = total / bandwidth
    t_cmp = flops / peak_flops if peak_flops and math.isfinite(peak_flops) else 0.0
    return {
        "weight_bytes_read": weight_bytes_read,
        "kv_bytes_read": kv_read,
        "bytes_read": total,
        "memory_time_s": t_mem,
        "compute_time_s": t_cmp,
        "step_time_s": max(t_mem, t_cmp) + overhead_s,
        "bound": "compute" if t_cmp > t_mem else "memory",
    }


def intensity(flops: float, nbytes: float) -> float:
    return flops / nbytes if nbytes else math.inf


# ---------------------------------------------------------------------------------------------
# Model-level quantities
# ---------------------------------------------------------------------------------------------

def activation_reserve_bytes(p: PlanInputs) -> float:
    """Rough peak of non-KV, non-weight memory during a step (vLLM profiles this; we estimate it):
    one prefill chunk's hidden/MLP activations in the compute dtype plus fp32 logits for the
    sampled rows (one per running sequence)."""
    m = p.model
    act_bytes = 4 if p.weight_dtype == "fp32" else 2
    inter = max(m.intermediate_size, m.moe_intermediate_size * max(m.num_experts_per_tok, 1)) / p.tp
    per_token = 4 * m.hidden_size + 3 * inter
    logits = min(p.max_num_seqs, p.max_num_batched_tokens) * m.vocab_size / p.tp * 4
    return p.max_num_batched_tokens * per_token * act_bytes + logits


def routed_expert_params(p: PlanInputs) -> int:
    """Every MoE layer's routed experts (without redundant replicas)."""
    m = p.model
    return m.num_moe_layers * m.num_experts * m.expert_params() if m.is_moe else 0


def weight_bytes_per_gpu(p: PlanInputs) -> float:
    """Under expert parallelism each rank holds (experts + redundant) / (dp x tp) whole experts per MoE
    layer and 1/tp of everything else; with pipeline stages, the heaviest stage's share; otherwise 1/tp
    of every weight."""
    if p.pp > 1:
        return max(s["weight_bytes"] for s in pipeline_stages(p))
    if not (p.expert_parallel and p.model.is_moe):
        return p.model.total_params() * p.weight_bytes / p.tp
    m, ep = p.model, p.dp * p.tp
    rest = (m.total_params() - routed_expert_params(p)) / p.tp
    experts = m.num_moe_layers * (m.num_experts + p.num_redundant_experts) / ep * m.expert_params()
    return (rest + experts) * p.weight_bytes


def expert_parallel_traffic(p: PlanInputs, batch: Optional[float] = None) -> Dict[str, float]:
    """One step's all-to-all traffic per rank under expert parallelism (the all_to_all backend), as the
    engine counts it (roofline:collective_bytes{group="ep",op="all_to_all"}: bytes sent to the OTHER ranks):
    per MoE layer the split counts (8 B per peer), then for each (token, expert) pair whose expert lives
    elsewhere its expert slot (8 B) and hidden row out, and the same number of rows back.  The batch of
    `batch` tokens (default p.batch, decode: one token per sequence) is spread over the dp x tp ranks; routing
    is taken as uniform, so a pair's expert is on another rank with probability (ep - 1) / ep."""
    m = p.model
    if not (p.expert_parallel and m.is_moe):
        return {"ep_size": 1, "all_to_all_bytes_per_step": 0.0, "redundant_expert_bytes_per_gpu": 0.0}
    ep = p.dp * p.tp
    tokens = (p.batch if batch is None else batch) / ep
    act = 4 if p.weight_dtype == "fp32" else 2
    remote_pairs = tokens * m.num_experts_per_tok * (ep - 1) / ep
    per_layer = 8 * (ep - 1) + remote_pairs * (8 + m.hidden_size * act) + remote_pairs * m.hidden_size * act
    redundant = m.num_moe_layers * p.num_redundant_experts / ep * m.expert_params() * p.weight_bytes
    return {"ep_size": ep, "all_to_all_bytes_per_step": per_layer * m.num_moe_layers,
            "redundant_expert_bytes_per_gpu": redundant}


def pp_bubble_fraction(pp: int, microbatches: int) -> float:
    """Idle share of a pipeline that runs `microbatches` batches per flush: (pp - 1) / (m + pp - 1)."""
    return (pp - 1) / (microbatches + pp - 1)


def pp_activation_bytes(p: PlanInputs, tokens: float) -> float:
    """Bytes one stage hands the next for `tokens` rows: hidden states and residual."""
    return 2.0 * tokens * p.model.hidden_size * (4 if p.weight_dtype == "fp32" else 2)


def pipeline_stages(p: PlanInputs) -> List[Dict[str, Any]]:
    """Per stage: its layers, weight bytes per GPU and KV bytes per token (this stage's layers)."""
    from roofline.distributed.layout import stage_layer_ranges

    m = p.model
    ends = m.embedding_params + m.lm_head_params
    per_layer = (m.total_params() - ends) / m.num_layers  # the average layer (norms included)
    kv_all = kv_bytes_per_token(p)
    stages = []
    ranges = stage_layer_ranges(m.num_layers, p.pp, p.pp_layer_partition)
    for i, (a, b) in enumerate(ranges):
        params = (b - a) * per_layer
        if i == 0:
            params += m.embedding_params
        if i == len(ranges) - 1:
            # tied: the last stage holds the LM head's own copy of the table unless it is also the first
            params += m.lm_head_params or (m.embedding_params if i > 0 else 0)
        stages.append({"stage": i, "layers": [a, b], "num_layers": b - a,
                       "weight_bytes": params * p.weight_bytes / p.tp,
                       "kv_bytes_per_token": kv_all * (b - a) / m.num_layers})
    return stages


def pipeline_plan(p: PlanInputs) -> Dict[str, Any]:
    """Pipeline figures: stages (weights, KV, pool), bubble, bytes between stages, pipelined decode."""
    stages = pipeline_stages(p)
    reserve = 0.0 if p.kv_budget_bytes is not None else activation_reserve_bytes(p)
    for s in stages:
        if p.kv_budget_bytes is not None:
            budget = float(p.kv_budget_bytes)
        else:
            budget = max(p.hardware.memory_bytes * p.gpu_memory_utilization - s["weight_bytes"] - reserve, 0.0)
        s["kv_budget_bytes"] = budget
        s["kv_blocks"] = kv_pool(budget, s["kv_bytes_per_token"], p.block_size)["kv_blocks"]
    blocks = min(s["kv_blocks"] for s in stages)  # every stage holds the same block table
    mb = p.microbatches
    # one stage's step on b/m sequences: its share of the whole model's step (even split by layers)
    heaviest = max(s["num_layers"] for s in stages) / p.model.num_layers
    stage_step = decode_at(p, p.batch / mb)["step_time_s"] * heaviest
    round_s = (mb + p.pp - 1) * stage_step
    return {
        "pp": p.pp, "microbatches": mb, "stages": stages,
        "kv_blocks": blocks, "kv_tokens": blocks * p.block_size,
        "bubble_fraction": pp_bubble_fraction(p.pp, mb),
        "activation_bytes_per_decode_step": pp_activation_bytes(p, p.batch),
        "activation_bytes_per_prefill_chunk": pp_activation_bytes(p, p.max_num_batched_tokens),
        "decode_stage_step_ms": stage_step * 1e3,
        "decode_round_ms": round_s * 1e3,
        "decode_tokens_per_s": p.batch / round_s,
    }


def kv_bytes_per_token(p: PlanInputs) -> float:
    return p.model.kv_bytes_per_token(p.kv_bytes, p.tp)


def kv_budget(p: PlanInputs) -> Dict[str, float]:
    if p.kv_budget_bytes is not None:
        return {"kv_budget_bytes": float(p.kv_budget_bytes), "activation_reserve_bytes": 0.0, "kv_budget_source": "explicit"}
    reserve = activation_reserve_bytes(p)
    budget = p.hardware.memory_bytes * p.gpu_memory_utilization - weight_bytes_per_gpu(p) - reserve
    return {"kv_budget_bytes": max(budget, 0.0), "activation_reserve_bytes": reserve,
            "kv_budget_source": f"{p.gpu_memory_utilization:g} x memory - weights - activations"}


def attention_time(model, context: float, kv_dtype_bytes: float, bandwidth: float, attention_flops: float,
                   indexer_flops: Optional[float] = None, sparse_attention_flops: Optional[float] = None,
                   tp: int = 1) -> float:
    """Seconds of one decode token's attention over all layers at this context: its cache reads at the copy
    bandwidth, or its FLOPs at the kernels' measured rates, whichever is longer.  The rates are those of the
    kernels that run (probes.py): MLA's over its attended rows (measure_attention_flops), and where DSA's
    indexer restricts them (a context past index_topk) its scores and top-k over the whole context
    (measure_indexer_flops) and the attention over the kept rows, gathered one by one
    (measure_sparse_attention_flops); a rate not given is attention_flops."""
    nbytes = model.kv_bytes_read_per_token(context, kv_dtype_bytes, tp)
    indexer = model.indexer_flops_per_token(context)
    attention = model.attention_flops_per_token(context, "decode") - indexer
    attention_rate = (sparse_attention_flops or attention_flops) if indexer else attention_flops
    compute = attention / attention_rate + indexer / (indexer_flops or attention_flops)
    return max(nbytes / bandwidth, compute)


def decode_flops(p: PlanInputs, batch: float, context: float) -> float:
    m = p.model
    return batch * (2.0 * m.active_params() + m.attention_flops_per_token(context, "decode")) / p.tp


def decode_weight_bytes_read(p: PlanInputs, batch: float) -> float:
    return p.model.weight_params_read(batch) * p.weight_bytes / p.tp


def decode_at(p: PlanInputs, batch: float, context: Optional[float] = None) -> Dict[str, float]:
    """Decode-step figures for `batch` sequences at average context `context` (default avg_context)."""
    s = p.avg_context if context is None else context
    flops = decode_flops(p, batch, s)
    # cache bytes a token reads, per position of its context (DSA reads fewer than it holds)
    read_per_position = p.model.kv_bytes_read_per_token(s, p.kv_bytes, p.tp) / s if s else kv_bytes_per_token(p)
    out = decode_step_time(decode_weight_bytes_read(p, batch), read_per_position, batch, s,
                           p.hardware.hbm_bandwidth, flops, p.peak_flops, p.step_overhead_s)
    out["flops"] = flops
    out["intensity"] = intensity(flops, out["bytes_read"])
    out["tokens_per_s"] = batch / out["step_time_s"]
    return out


def saturation_batch(p: PlanInputs, context: Optional[float] = None) -> float:
    """Batch b* at which the KV read equals the weight read: W_read(b*) = b* * S * K_tok.

    For a dense model this is W / (S * K_tok) (deep-dive-08 section 3); for an MoE model the weight
    read grows with the batch (more experts touched), so the fixed point is found by bisection."""
    s = p.avg_context if context is None else context
    per_seq = s * kv_bytes_per_token(p)
    if per_seq <= 0:
        return math.inf
    f = lambda b: decode_weight_bytes_read(p, b) - b * per_seq  # noqa: E731 (decreasing past b*)
    lo, hi = 0.0, 1.0
    while f(hi) > 0:
        lo, hi = hi, hi * 2
        if hi > 1e12:
            return math.inf
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
    return 0.5 * (lo + hi)


def prefill(p: PlanInputs, tokens: Optional[int] = None) -> Dict[str, float]:
    """One forward pass over a `tokens`-token prompt (default: --context): compute-bound roofline."""
    m = p.model
    n = p.context if tokens is None else tokens
    # causal: token i attends to i positions (a sliding layer to at most its window)
    attn = m.attention_flops_over(0, n, "prefill")
    flops = (2.0 * m.active_params() * n + attn) / p.tp
    nbytes = decode_weight_bytes_read(p, n) + n * kv_bytes_per_token(p)
    t_cmp = flops / p.peak_flops
    t_mem = nbytes / p.hardware.hbm_bandwidth
    return {"prefill_flops": flops, "prefill_bytes": nbytes, "prefill_s": max(t_cmp, t_mem) + p.step_overhead_s,
            "prefill_intensity": intensity(flops, nbytes), "prefill_bound": "compute" if t_cmp > t_mem else "memory"}


@dataclass
class Plan:
    inputs: Dict[str, Any]
    model: Dict[str, Any]
    hardware: Dict[str, Any]
    results: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {**self.results, "inputs": self.inputs, "model": self.model, "hardware": self.hardware}


def make_plan(p: PlanInputs) -> Plan:
    m, hw = p.model, p.hardware
    kvtok = kv_bytes_per_token(p)
    budget = kv_budget(p)
    pool = kv_pool(budget["kv_budget_bytes"], kvtok, p.block_size)
    dec = decode_at(p, p.batch)
    pre = prefill(p)
    weights = weight_bytes_per_gpu(p)
    needed_blocks = p.batch * blocks_per_seq(p.avg_context, p.block_size)
    r = {
        "weight_bytes_per_gpu": weights,
        "weights_fit": weights <= hw.memory_bytes * p.gpu_memory_utilization,
        "kv_bytes_per_token": kvtok,
        "kv_budget_bytes": budget["kv_budget_bytes"],
        "activation_reserve_bytes": budget["activation_reserve_bytes"],
        "kv_block_bytes": pool["kv_block_bytes"],
        "kv_blocks": pool["kv_blocks"],
        "kv_tokens": pool["kv_tokens"],
        "max_request_tokens": max_request_tokens(m, budget["kv_budget_bytes"], p.block_size, p.kv_bytes, p.tp),
        "max_seqs_at_context": paged_capacity(pool["kv_blocks"], p.context, p.block_size),
        "naive_max_seqs": naive_capacity(budget["kv_budget_bytes"], kvtok, p.context),
        "paged_max_seqs": paged_capacity(pool["kv_blocks"], p.avg_context, p.block_size),
        "decode_step_ms": dec["step_time_s"] * 1e3,
        "decode_tokens_per_s": dec["tokens_per_s"],
        "decode_bound": dec["bound"],
        "decode_weight_bytes_read": dec["weight_bytes_read"],
        "decode_kv_bytes_read": dec["kv_bytes_read"],
        "decode_flops": dec["flops"],
        "decode_intensity_flops_per_byte": dec["intensity"],
        "ridge_flops_per_byte": p.peak_flops / hw.hbm_bandwidth,
        "saturation_batch": saturation_batch(p),
        "prefill_ms": pre["prefill_s"] * 1e3,
        "prefill_bound": pre["prefill_bound"],
        "prefill_intensity_flops_per_byte": pre["prefill_intensity"],
        "kv_bytes_at_batch": p.batch * p.avg_context * kvtok,
        "kv_blocks_needed_at_batch": needed_blocks,
        "kv_fits_at_batch": needed_blocks <= pool["kv_blocks"],
    }
    if p.pp > 1:  # the pool and the decode rate are the pipeline's
        pipe = pipeline_plan(p)
        r["pipeline"] = pipe
        r.update(kv_blocks=pipe["kv_blocks"], kv_tokens=pipe["kv_tokens"],
                 max_seqs_at_context=paged_capacity(pipe["kv_blocks"], p.context, p.block_size),
                 paged_max_seqs=paged_capacity(pipe["kv_blocks"], p.avg_context, p.block_size),
                 kv_fits_at_batch=needed_blocks <= pipe["kv_blocks"])
    if p.expert_parallel and m.is_moe:
        r.update(expert_parallel_traffic(p))
    inputs = {
        "tp": p.tp, "pp": p.pp, "dp": p.dp, "expert_parallel": p.expert_parallel,
        "num_redundant_experts": p.num_redundant_experts, "weight_dtype": p.weight_dtype, "kv_dtype": p.kv_dtype,
        "gpu_memory_utilization": p.gpu_memory_utilization, "kv_budget_bytes": p.kv_budget_bytes,
        "block_size": p.block_size, "context": p.context, "avg_context": p.avg_context, "batch": p.batch,
        "step_overhead_s": p.step_overhead_s, "kv_budget_source": budget["kv_budget_source"],
    }
    hwd = {"name": hw.name, "memory_bytes": hw.memory_bytes, "hbm_bandwidth_bytes_per_s": hw.hbm_bandwidth,
           "peak_flops": p.peak_flops, "measured": hw.measured, "description": hw.description}
    return Plan(inputs=inputs, model=m.summary(), hardware=hwd, results=r)


def sweep(p: PlanInputs, batches: List[int]) -> List[Dict[str, float]]:
    """Decode figures over a list of batch sizes (for plots)."""
    rows = []
    for b in batches:
        d = decode_at(p, b)
        rows.append({"batch": b, "step_ms": d["step_time_s"] * 1e3, "tokens_per_s": d["tokens_per_s"],
                     "memory_ms": d["memory_time_s"] * 1e3, "compute_ms": d["compute_time_s"] * 1e3,
                     "bound": d["bound"]})
    return rows
