"""RMSNorm, computed in fp32 like the reference, optionally fused with the residual add."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from roofline.model_executor.layers import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without residual: norm(x).  With residual: (norm(x + residual), x + residual)."""
        if fused_ops.active(x):  # one fused kernel (Triton on CUDA, native on CPU), same contract
            return fused_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
