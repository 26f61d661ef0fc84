"""The switch between the torch layers and fused kernels: Triton (triton_ops) on CUDA, native C
(cpu_ops) on CPU.

The layers (RMSNorm, SiluAndMul, GeluTanhAndMul, RotaryEmbedding) ask `active(x)` at the top of forward and, when it
says yes, return the fused result instead of running their torch code:

    if fused_ops.active(x):
        return fused_ops.rms_norm(x, self.weight, self.eps, residual)

For CUDA tensors active(x) follows this module's switch: on by default, off with ROOFLINE_FUSED_OPS=0
in the environment or, at run time, use_fused_ops(False) (use_fused_ops(None) goes back to the
environment's setting); it stays off if triton cannot be imported.  For CPU tensors it follows
cpu_ops's switch (--cpu-kernels, cpu_ops.use_cpu_kernels) and holds for fp32 only.  The torch
code stays the reference both kernel sets are tested against.

This module does not import triton: triton_ops is imported on the first fused call (CUDA only), so
importing the layers costs nothing on CPU-only installs.
"""

from __future__ import annotations

from typing import Optional

import torch

from roofline.config import Switch
from roofline.cpu import ops as cpu_ops

ENV_VAR = "ROOFLINE_FUSED_OPS"
SWITCH = Switch(ENV_VAR)

_triton_importable: Optional[bool] = None
_ops = None  # the triton_ops module once imported


def enabled() -> bool:
    """Whether CUDA tensors go through the fused kernels (the environment's default also needs
    triton to import)."""
    global _triton_importable
    if SWITCH.override is not None:
        return SWITCH.override
    if not SWITCH.on():
        return False
    if _triton_importable is None:
        try:
            import triton  # noqa: F401

            _triton_importable = True
        except Exception:  # pragma: no cover - triton is installed wherever CUDA is used
            _triton_importable = False
    return _triton_importable


def active(x: torch.Tensor) -> bool:
    """The test the layers make: a CUDA tensor and the switch on, or an fp32 CPU tensor and the
    native CPU kernels loaded."""
    if x.is_cuda:
        return enabled()
    return x.dtype == torch.float32 and x.device.type == "cpu" and cpu_ops.available()


def use_fused_ops(enabled: Optional[bool] = True) -> None:
    """Turn the fused kernels on (True) or off (False) for the whole process; None = the env default.
    Takes effect at the next forward (not inside an already captured CUDA graph)."""
    SWITCH.set(enabled)


forced = SWITCH.forced  # temporarily force the switch (benchmarks, A/B checks)


def _triton_ops():
    global _ops
    if _ops is None:
        from roofline.model_executor.layers import triton_ops

        _ops = triton_ops
    return _ops


# ---- the fused calls (same contracts as the torch layers) ------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """RMSNorm.forward: norm(x), or (norm(x + residual), x + residual)."""
    if not x.is_cuda:
        return cpu_ops.rms_norm(x, weight, eps, residual)
    return _triton_ops().rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiluAndMul.forward: silu(x[..., :d]) * x[..., d:]."""
    if not x.is_cuda:
        return cpu_ops.silu_and_mul(x)
    return _triton_ops().silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeluTanhAndMul.forward: gelu_tanh(x[..., :d]) * x[..., d:] (native on CPU; CUDA keeps the torch code)."""
    if not x.is_cuda:
        return cpu_ops.gelu_tanh_and_mul(x)
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def can_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    """The fused rope handles this call (otherwise the torch code runs): same dtypes (cos_sin casts
    the tables to q's), unit-stride head dim."""
    if not q.is_cuda:
        return cpu_ops.can_rotary(q, k, cos)
    return q.dtype == k.dtype == cos.dtype and q.stride(-1) == 1 and k.stride(-1) == 1 and q.dim() == 3


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RotaryEmbedding.forward on (q, k), rotating them IN PLACE; returns (q, k)."""
    if not q.is_cuda:
        return cpu_ops.rotary_(q, k, cos, sin)
    return _triton_ops().rotary_embedding_(q, k, cos, sin)
