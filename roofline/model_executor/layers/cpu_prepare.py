"""Setting a loaded model up for the CPU fast path: weights [in x out]-major (relayout), packed copies beside
them (pack_model, cpu_gemm.pack), each module's own prepare_cpu(), and the LM head's greedy screen.  It walks
the model's layers; the layers call cpu_gemm, which knows none of them."""

from __future__ import annotations

import torch

from roofline.cpu import gemm as cpu_gemm
from roofline.cpu.greedy_head import GreedyScreen
from roofline.model_executor.layers.linear import LinearBase
from roofline.model_executor.layers.vocab_embedding import ParallelLMHead


def relayout(model: torch.nn.Module) -> None:
    """Store every projection and LM head weight [in x out]-major (weight.t() contiguous).  An input
    embedding keeps its rows, unless it shares its weight with the LM head: a lookup then reads one
    contiguous row, where [in x out]-major it reads one value per vocabulary row (one token with cold
    caches, as in a decode step, 49152 x 576: ~90 us against ~150 us).

    x @ W^T then runs as a plain GEMM over W^T, which on CPU reads weights about 1.3x (layers)
    to 2x (a 49k-row LM head) faster than over row-major W for one row (measured:
    `roofline bench throughput --workload w5`), and it is the layout cpu_ops.gemv reads.
    Shapes and values are unchanged; only strides.
    """

    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            w = module.weight
            if id(w) not in seen and w.dim() == 2 and w.device.type != "meta":  # meta: kept in GGUF blocks
                seen.add(id(w))
                w.data = w.data.t().contiguous().t()


def pack_model(model: torch.nn.Module) -> int:
    """Pack the fp32 weight of every linear layer (not those kept in GGUF blocks) and of the LM head;
    returns how many were packed."""

    n = 0
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)) and getattr(module, "quant", None) is None:
            module.cpu_packed = cpu_gemm.pack(module.weight)
            n += module.cpu_packed is not None
    return n


def prepare_model(model: torch.nn.Module) -> None:
    """After loading a model onto the CPU: dense weights [in x out]-major, packed copies beside them
    (and each module's own `prepare_cpu()`), and the LM head's int8 screen for greedy rows (greedy_head.py; tp 1)."""

    relayout(model)
    pack_model(model)
    for module in model.modules():  # layers with their own packed copies (moe.FusedMoE's experts)
        if hasattr(module, "prepare_cpu"):
            module.prepare_cpu()
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and module.tp_size == 1 and module.cpu_packed is not None:
            module.cpu_greedy = GreedyScreen.cached(module.weight, module.vocab_size)
