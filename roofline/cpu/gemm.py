"""How the fp32 projections of a model on the CPU run: natively packed weights for batches, a
threaded native GEMV for single rows.

torch's default CPU GEMM (MKL) re-packs the weight matrix on every call; at decode batch sizes that
packing is a large share of the work, and a batch of a few dozen rows is too short for its blocking
(an LM head of 49k rows runs at ~55 GFLOP/s at 37 rows on the 2-core reference machine).  After
loading, `cpu_prepare.pack_model` lays each projection's weight out once in column panels (cpu_ops.pack_panels)
and the layers multiply batches of 2 rows or more with cpu_ops.gemm_packed (~150-190 GFLOP/s at
decode batch sizes, where oneDNN with a pre-packed weight, used here before, reached ~115-145; and
~175 on 2048-row prefill chunks, where MKL reaches ~155).

Each packed module keeps its dense `weight` parameter too: single rows go through it (use_packed),
and loaders, tied embeddings and tests read it.  That doubles the CPU memory of the weights, which
pays on the small models a CPU serves.  Without the native kernels (no C
compiler, --no-cpu-kernels) nothing is packed and F.linear runs as before.

A single row (one stream decoding) is a GEMV, bound by streaming the weights: the native kernel
(cpu_ops.gemv: each thread streams a run of whole weight rows) reads the dense [in x out] weight, which
streams from DRAM faster than a 1-row panel tile.  MKL's GEMV runs on one thread whatever torch's
thread count (2 threads on the reference machine: native ~25-30 vs MKL ~17 GB/s; on one thread the
two are even, ~15-16 GB/s over the default model's projections).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F

from roofline.cpu import ops as cpu_ops

# One row uses the dense weight: the native GEMV streams it from memory faster than a one-row panel tile.
PACKED_MIN_ROWS = 2


def available() -> bool:
    """Whether weights can be packed here (the native CPU kernels load)."""
    return cpu_ops.available()


def pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """weight [out x in] (any strides) -> its column panels for cpu_ops.gemm_packed, or None when it
    cannot be packed here (native kernels off, not a 2-D fp32 weight)."""
    if not available() or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    return cpu_ops.pack_panels(weight)


def use_packed(x: torch.Tensor) -> bool:
    """Whether a batch of this many rows goes through the packed weight (given there is one)."""
    return x.shape[0] >= PACKED_MIN_ROWS


def routes_alike(rows_a: int, rows_b: int, quantized: Iterable = ()) -> bool:
    """Whether batches of these many rows take the same route (so a row comes out the same bits in either):
    the fp32 weights' (GEMV or packed) and, for these quantized weights (GGUF or FP8 blocks), theirs (the
    per-row GEMV routes or the packed GEMM: their rows_route)."""
    if rows_a == rows_b:
        return True
    return ((rows_a >= PACKED_MIN_ROWS) == (rows_b >= PACKED_MIN_ROWS)
            and all(q.rows_route(rows_a) == q.rows_route(rows_b) for q in quantized))


def _takes_packed(x: torch.Tensor, packed: Optional[torch.Tensor]) -> bool:
    """An fp32 CPU batch [rows, in] of PACKED_MIN_ROWS or more, and a packed weight to multiply it with."""
    return (packed is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and use_packed(x))


def linear(x: torch.Tensor, weight: torch.Tensor, packed: Optional[torch.Tensor],
           bias: Optional[torch.Tensor] = None, quant=None) -> torch.Tensor:
    """F.linear(x, weight, bias); for fp32 CPU input by the fastest route this batch has.  With `quant`
    (a quantized weight: GGUF or FP8 blocks, layers/quantization; `weight` then holds no values) its own
    native route."""
    if quant is not None:
        return quant.linear(x, bias)
    if _takes_packed(x, packed):
        return cpu_ops.gemm_packed(x, packed, weight.shape[0], bias)
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if x.shape[0] == 1 and cpu_ops.available() and cpu_ops.can_gemv(x, weight):
        return cpu_ops.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def gate_up_silu(x: torch.Tensor, gate_up) -> Optional[torch.Tensor]:
    """silu(gate(x)) * up(x) for a MergedColumnParallelLinear [gate; up] layer in one native pass: over its
    quantized blocks where it keeps them (their linear_silu_mul), else over its packed weight
    (cpu_ops.gemm_packed_silu_mul); None where that does not apply (the caller runs the projection and
    SiluAndMul): a bias, a LoRA delta to add before the SiLU this step, or (fp32 weights) not a packed fp32 CPU
    batch of 2+ rows or halves not 16-aligned."""
    lora = getattr(gate_up, "lora", None)
    if gate_up.bias is not None or (lora is not None and lora.state.active):
        return None
    if gate_up.quant is not None:
        return gate_up.quant.linear_silu_mul(x)
    d = gate_up.weight.shape[0] // 2
    if not _takes_packed(x, gate_up.cpu_packed) or d % cpu_ops.PANEL:
        return None
    return cpu_ops.gemm_packed_silu_mul(x, gate_up.cpu_packed, d)
