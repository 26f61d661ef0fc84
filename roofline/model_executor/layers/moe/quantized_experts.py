"""The expert compute of a MoE layer whose expert stacks stay in FP8 blocks (quantization/fp8.py).

Tokens are grouped by expert (one stable argsort, as torch_experts does); each active expert runs its
gate/up projection with SiLU-and-mul (fused on the CPU's native route) and its down projection through the
FP8 tensor's own `linear` -- the CPU's native kernels, so every expert reads its one-byte weights once per
step -- then the routing-weighted rows are summed back per token.  The function is torch_experts' over the
dequantized stacks (tested within fp32 rounding; each expert's projections are bit for bit the native
linear's).
"""

from __future__ import annotations

import torch

from roofline.model_executor.layers.activation import SiluAndMul
from roofline.model_executor.layers.moe.torch_experts import grouped_by_expert

_silu_and_mul = SiluAndMul()


def quantized_experts(x: torch.Tensor, w13, w2, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [N, H], w13 [E, 2I, H] and w2 [E, H, I] FP8 block stacks (quantization/fp8.py), weights/ids [N, k] -> [N, H]."""
    n, k = ids.shape
    order, counts = grouped_by_expert(ids, w13.shape[0])
    x_sorted = x.index_select(0, order // k)  # [N*k, H], rows of one expert together
    y_sorted = torch.empty_like(x_sorted)
    start = 0
    for e, c in enumerate(counts.tolist()):  # experts, not tokens: the idle ones cost nothing
        if c:
            rows = x_sorted[start:start + c]
            gate_up = w13[e]
            h = gate_up.linear_silu_mul(rows)
            if h is None:
                h = _silu_and_mul(gate_up.linear(rows))
            y_sorted[start:start + c] = w2[e].linear(h)
            start += c
    y_sorted *= weights.reshape(-1).index_select(0, order).to(x.dtype)[:, None]
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
    return y.view(n, k, -1).sum(dim=1)
