"""The expert compute of a MoE layer on the CPU in fp32, on the native kernels of cpu_ops.py.

Tokens are grouped by expert with one stable argsort of the chosen ids (no Python loop over tokens).
Where the expert width is a multiple of 16 (every W6/DeepSeek/Qwen/Mixtral shape), the whole layer is
then ONE native call (cpu_ops.moe_experts): gather the rows, every active expert's gate/up GEMM with
the SiLU-and-mul fused in and its down GEMM on the packed panels -- the (expert, row block, panel
group) work items of all experts dealt to one thread team -- and the routing-weighted sum back per
token.  Other widths run one native call per projection of each ACTIVE expert (the packed GEMM, or
the threaded GEMV for a single row) and combine in torch.  gpt-oss's experts (biases, the clamped
SwiGLU of torch_experts.ExpertActivation) take the one native call at any width: its gate/up GEMM adds
the bias, an activation pass follows, the down GEMM adds its bias (given by the layer only where the
reference adds it: TP rank 0).

`CpuExperts.build` makes, once after loading (cpu_prepare.prepare_model), a packed copy of every
expert's two weights (cpu_ops.pack_panels) and lays the dense stacks out [in x out]-major per expert
(the GEMV's layout; shapes unchanged).  Not bit-for-bit the torch reference (other summation order),
within fp32 rounding of it (tested).  Switch: --cpu-moe-kernels (on by default; off runs the torch
reference, for A/B runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from roofline.config import Switch
from roofline.cpu import ops as cpu_ops
from roofline.model_executor.layers.moe.torch_experts import SILU, ExpertActivation, grouped_by_expert

SWITCH = Switch("cpu_moe_kernels")


def _gemv_major(w: torch.Tensor) -> torch.Tensor:
    """[E, out, in] -> the same values with each expert's matrix stored [in x out]-major."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@dataclass
class CpuExperts:
    w13_packed: torch.Tensor  # [E, panels of the [2I, H] gate/up weight]
    w2_packed: torch.Tensor  # [E, panels of the [H, I] down weight]
    inter: int
    hidden: int

    @staticmethod
    def build(w13: torch.nn.Parameter, w2: torch.nn.Parameter) -> Optional["CpuExperts"]:
        """Pack the experts for the native kernels (and relayout the dense stacks in place), or None
        where they do not apply (kernels off, not fp32 on the CPU)."""
        if not cpu_ops.available() or w13.dtype != torch.float32 or w13.device.type != "cpu":
            return None
        w13.data = _gemv_major(w13.data)
        w2.data = _gemv_major(w2.data)
        w13_packed = torch.stack([cpu_ops.pack_panels(w13[e]) for e in range(w13.shape[0])])
        w2_packed = torch.stack([cpu_ops.pack_panels(w2[e]) for e in range(w2.shape[0])])
        return CpuExperts(w13_packed, w2_packed, inter=w2.shape[2], hidden=w2.shape[1])

    def takes(self, x: torch.Tensor) -> bool:
        return (SWITCH.on() and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
                and cpu_ops.available())

    def _expert(self, rows: torch.Tensor, e: int, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """rows [c, H] through expert e -> [c, H] (widths that are not a multiple of 16)."""
        if rows.shape[0] == 1 and cpu_ops.can_gemv(rows, w13[e]):
            h = cpu_ops.silu_and_mul(cpu_ops.gemv(rows, w13[e]))
            if cpu_ops.can_gemv(h, w2[e]):
                return cpu_ops.gemv(h, w2[e])
            return cpu_ops.gemm_packed(h, self.w2_packed[e], self.hidden)
        if self.inter % cpu_ops.PANEL == 0:
            h = cpu_ops.gemm_packed_silu_mul(rows, self.w13_packed[e], self.inter)
        else:
            h = cpu_ops.silu_and_mul(cpu_ops.gemm_packed(rows, self.w13_packed[e], 2 * self.inter))
        return cpu_ops.gemm_packed(h, self.w2_packed[e], self.hidden)

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor, activation: ExpertActivation = SILU, b13: Optional[torch.Tensor] = None,
                 b2: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As torch_experts.torch_experts (x [N, H], weights/ids [N, k] -> [N, H]; activation, b13 [E, 2I],
        b2 [E, H] as there)."""
        n, k = ids.shape
        order, counts = grouped_by_expert(ids, w13.shape[0])
        tokens = order // k
        plain = activation.is_silu and b13 is None and b2 is None
        if self.inter % cpu_ops.PANEL == 0 or not plain:
            offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
            torch.cumsum(counts, 0, out=offsets[1:])
            slot_row = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
            return cpu_ops.moe_experts(x, tokens, slot_row, weights.reshape(-1).to(torch.float32).contiguous(),
                                       offsets, self.w13_packed, self.w2_packed, self.inter,
                                       b13=None if b13 is None else b13.contiguous(),
                                       b2=None if b2 is None else b2.contiguous(), activation=activation.kind,
                                       alpha=activation.alpha, limit=activation.limit)
        x_sorted = x.index_select(0, tokens)  # [N*k, H], rows of one expert together
        y_sorted = torch.empty_like(x_sorted)
        start = 0
        for e, c in enumerate(counts.tolist()):  # experts, not tokens: the idle ones cost nothing
            if c:
                y_sorted[start:start + c] = self._expert(x_sorted[start:start + c], e, w13, w2)
                start += c
        y_sorted *= weights.reshape(-1).index_select(0, order).to(x.dtype)[:, None]
        # back to (token, slot) order, then each token's k rows summed (index_add_ is ~10x slower here)
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
        return y.view(n, k, -1).sum(dim=1)
