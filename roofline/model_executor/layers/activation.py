"""The gated activations on the merged [gate | up] projection output: SiLU-and-mul (SwiGLU) and
tanh-GELU-and-mul (GeGLU, Gemma)."""

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


class GeluTanhAndMul(nn.Module):
    """gelu(x[..., :d], approximate="tanh") * x[..., d:]: one native pass on fp32 CPU tensors (cpu_ops), the torch
    code elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda and fused_ops.active(x):
            return fused_ops.gelu_tanh_and_mul(x)
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
