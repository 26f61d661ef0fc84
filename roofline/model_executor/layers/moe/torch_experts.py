"""The reference expert compute of a MoE layer in plain torch: for each expert that some token chose,
y = down(act(gate(x), up(x))) over its tokens, scaled by the routing weight and summed back per token.
Every backend path (cpu_experts.py, triton_moe.py) is tested against this function.

`ExpertActivation` says how an expert joins its gate and up projections: SiLU-and-mul (every family but one,
and the only one the native CPU kernels and the FP8 expert route fuse), or gpt-oss's clamped SwiGLU
(gate clamped above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)).
Experts may also carry biases (gpt-oss): b13 [E, 2I] added to the gate/up projection, b2 [E, H] to the
down projection, both before the routing weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class ExpertActivation:
    """act(gate_up) for rows [M, 2I] (gate columns, then up columns) -> [M, I]."""

    kind: str = "silu"  # "silu" | "clamped_swiglu" (gpt-oss)
    alpha: float = 1.702  # clamped_swiglu: the sigmoid's gain (HF swiglu_alpha)
    limit: float = 7.0  # clamped_swiglu: the clamp (HF swiglu_limit)

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.kind!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.kind == "clamped_swiglu" and not self.limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {self.limit}")

    @property
    def is_silu(self) -> bool:
        return self.kind == "silu"

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :inter], gate_up[..., inter:]
        if self.kind == "silu":
            return F.silu(gate) * up
        # as HF's GptOssExperts._apply_gate, in its order of operations
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu


SILU = ExpertActivation()


def grouped_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, k] -> (order [N*k]: the flat (token, slot) indices sorted by expert, stable;
    counts [num_experts]: how many of them each expert got).  Token of order[j] is order[j] // k."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def torch_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, activation: ExpertActivation = SILU, b13: Optional[torch.Tensor] = None,
                  b2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [N, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], weights/ids [N, k] -> [N, H];
    b13 [E, 2I] / b2 [E, H]: the experts' biases (None: none)."""
    n, k = ids.shape
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
        h = activation(F.linear(x[tok], w13[e], None if b13 is None else b13[e]))
        y = F.linear(h, w2[e], None if b2 is None else b2[e]) * flat_weights[sel, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out
