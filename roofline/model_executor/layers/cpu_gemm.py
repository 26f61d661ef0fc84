"""How the fp32 projections of a model on the CPU run: pre-packed oneDNN weights for batches,
a threaded native GEMV for single rows, MKL for the rest.

torch's default CPU GEMM (MKL) re-packs the weight matrix on every call; at decode batch sizes that
packing is a large share of the work (an LM head of 49k rows runs at ~45 GFLOP/s at 37 rows on the
2-core reference machine, 115 GFLOP/s pre-packed).  After loading, `pack_model` reorders each
projection's weight once into oneDNN's blocked layout; the layers then call oneDNN's linear on it.

Each packed module keeps its dense `weight` parameter too: single rows and big prefill batches go
through it (use_packed), and loaders, tied embeddings and tests read it.  That doubles the CPU memory
of the weights, which pays on the small models a CPU serves.  Packing needs a torch built with oneDNN
(`torch.backends.mkldnn.is_available()`, true for the x86 and aarch64 wheels); without it nothing is
packed and F.linear runs as before.

A single row (one stream decoding) is a GEMV, bound by streaming the weights: MKL's runs on one
thread whatever torch's thread count, so with more than one thread the native kernel
(cpu_ops.gemv: output columns split among the threads) reads the dense [in x out] weight instead
(2 threads on the reference machine: ~22 vs ~17 GB/s).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

from roofline.model_executor.layers import cpu_ops

logger = logging.getLogger(__name__)

# Batches outside [MIN, MAX) use the dense weight: one row because MKL / the native GEMV stream it
# faster than oneDNN (W5: 45 vs 69 ms/token, 1 thread); big prefill chunks because MKL's own
# packing is amortized there and it runs ~5% faster.
PACKED_MIN_ROWS = 2
PACKED_MAX_ROWS = 1024
PACK_BATCH_HINT = 64  # the batch size oneDNN tunes the layout for (decode batches are ~1..256 rows)


def available() -> bool:
    return bool(torch.backends.mkldnn.is_available())


def pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """weight [out x in] (any strides) -> an opaque oneDNN tensor for packed_linear, or None."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)
    except (RuntimeError, AttributeError) as e:  # a build without oneDNN's linear
        logger.warning("cannot pre-pack CPU weights (%s); using F.linear", e)
        return None


def use_packed(x: torch.Tensor) -> bool:
    """Whether a batch of this many rows goes through the packed weight (given there is one)."""
    return PACKED_MIN_ROWS <= x.shape[0] < PACKED_MAX_ROWS


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [N x in] @ W^T (+ bias) with W pre-packed by pack()."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, packed: Optional[torch.Tensor],
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias); for fp32 CPU input by the fastest route this batch has."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if packed is not None and use_packed(x):
        return packed_linear(x, packed, bias)
    if x.shape[0] == 1 and torch.get_num_threads() > 1 and cpu_ops.available() and cpu_ops.can_gemv(x, weight):
        return cpu_ops.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def relayout(model: torch.nn.Module) -> None:
    """Store every projection, embedding and LM head weight [in x out]-major (weight.t() contiguous).

    x @ W^T then runs as a plain GEMM over W^T, which on CPU reads weights about 1.3x (layers)
    to 2x (a 49k-row LM head) faster than over row-major W for one row (measured:
    `roofline bench throughput --workload w5`), and it is the layout cpu_ops.gemv reads.
    Shapes and values are unchanged; only strides.
    """
    from roofline.model_executor.layers.linear import LinearBase
    from roofline.model_executor.layers.vocab_embedding import VocabParallelEmbedding

    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, (LinearBase, VocabParallelEmbedding)):
            w = module.weight
            if id(w) not in seen and w.dim() == 2:
                seen.add(id(w))
                w.data = w.data.t().contiguous().t()


def pack_model(model: torch.nn.Module) -> int:
    """Pack the fp32 weight of every linear layer and of the LM head; returns how many were packed."""
    from roofline.model_executor.layers.linear import LinearBase
    from roofline.model_executor.layers.vocab_embedding import ParallelLMHead

    if not available():
        return 0
    n = 0
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)) and module.weight.dtype == torch.float32:
            module.cpu_packed = pack(module.weight)
            n += module.cpu_packed is not None
    return n


def prepare_model(model: torch.nn.Module) -> None:
    """After loading a model onto the CPU: dense weights [in x out]-major, packed copies beside them."""
    relayout(model)
    pack_model(model)
