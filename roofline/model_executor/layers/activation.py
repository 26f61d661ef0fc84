"""SiLU-and-mul: the SwiGLU gate, on the merged [gate | up] projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roofline.model_executor.layers import fused_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.active(x):  # one fused kernel (Triton on CUDA, native on CPU)
            return fused_ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
