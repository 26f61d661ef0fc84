"""The reference expert compute of a MoE layer in plain torch: for each expert that some token chose,
y = down(silu(gate(x)) * up(x)) over its tokens, scaled by the routing weight and summed back per token.
Every backend path (cpu_experts.py, triton_moe.py) is tested against this function."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, k] -> (order [N*k]: the flat (token, slot) indices sorted by expert, stable;
    counts [num_experts]: how many of them each expert got).  Token of order[j] is order[j] // k."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def torch_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """x [N, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], weights/ids [N, k] -> [N, H]."""
    n, k = ids.shape
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    order, counts = grouped_by_expert(ids, w13.shape[0])
    tokens = order // k
    flat_weights = weights.reshape(-1)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        sel, tok = order[start:start + c], tokens[start:start + c]
        start += c
        gate_up = F.linear(x[tok], w13[e])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w2[e]) * flat_weights[sel, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out
