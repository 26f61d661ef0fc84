"""FP8 block weights multiplied natively on the CPU (fp8_kernels.c), through ctypes.

The weight is raw e4m3 bytes (uint8 [N x K], rows contiguous) with fp32 scales [ceil(N / scale_rows) x
ceil(K / block_k)]; a weight's value is e4m3(byte) * its block's scale, rounded once in fp32 (what
`dequantize_reference` computes in torch).  `linear` computes F.linear(x, that weight, bias): up to
ROWS_MAX rows by a GEMV that streams each byte once for all rows (each row's values the one-row GEMV's),
more rows by the packed GEMM over panels expanded on the fly (bit for bit cpu_ops.gemm_packed over the
dequantized weight).  The tensor that carries these (layers/quantization/fp8.py) calls this module.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from roofline.cpu import ops as cpu_ops

ROWS_MAX = 8  # fp8_kernels.c FP8_ROWS_MAX: rows the GEMV route takes

_P, _I = ctypes.c_void_p, ctypes.c_int64
cpu_ops.declare("fp8_dequantize_f32", [_P, _I, _I, _P, _I, _I, _I, _P, ctypes.c_int])
cpu_ops.declare("fp8_linear_f32", [_P, _I, _P, _I, _P, _I, _I, _I, _P, _P, _I, _I, _I, ctypes.c_int])
cpu_ops.declare("fp8_linear_silu_mul_f32", [_P, _I, _P, _I, _P, _I, _I, _I, _P, _I, _I, _I, ctypes.c_int])
cpu_ops.declare("fp8_rows_route", [_I], ctypes.c_int)

E4M3_MAX = 448.0


def e4m3_bytes(w: torch.Tensor) -> torch.Tensor:
    """A float8_e4m3fn (or uint8) tensor as its uint8 bytes."""
    return w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w


def expand_scales(scale: torch.Tensor, rows: int, cols: int, scale_rows: int, block_k: int) -> torch.Tensor:
    """fp32 [rows x cols]: every weight's block scale."""
    return (scale.repeat_interleave(scale_rows, 0)[:rows].repeat_interleave(block_k, 1)[:, :cols])


def dequantize_reference(data: torch.Tensor, scale: torch.Tensor, scale_rows: int, block_k: int) -> torch.Tensor:
    """fp32 [N x K] = e4m3 value x block scale, by torch (the reference the kernels equal bit for bit)."""
    values = e4m3_bytes(data).view(torch.float8_e4m3fn).to(torch.float32)
    return values * expand_scales(scale.to(torch.float32), *values.shape, scale_rows, block_k).to(values.device)


def _check(x: torch.Tensor, k: int) -> torch.Tensor:
    if not cpu_ops.accepts(x) or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"FP8 linear takes fp32 CPU rows [M x {k}] with unit stride, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    return x.contiguous() if x.shape[0] == 1 else x


def dequantize_native(data: torch.Tensor, scale: torch.Tensor, scale_rows: int, block_k: int) -> torch.Tensor:
    """fp32 [N x K] by the kernels' own expansion."""
    n, k = data.shape
    out = torch.empty((n, k), dtype=torch.float32)
    cpu_ops.library().fp8_dequantize_f32(data.data_ptr(), n, k, scale.data_ptr(), scale.stride(0), scale_rows,
                                         block_k, out.data_ptr(), torch.get_num_threads())
    return out


def linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, scale_rows: int, block_k: int,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, dequantized weight, bias) for fp32 CPU x [M x K]; data uint8 [N x K] contiguous, scale
    fp32 with unit column stride."""
    n, k = data.shape
    x = _check(x, k)
    m = x.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    if m == 0:
        return y
    b = None if bias is None else bias.contiguous()
    cpu_ops.library().fp8_linear_f32(x.data_ptr(), x.stride(0), data.data_ptr(), k, scale.data_ptr(), scale.stride(0),
                                     scale_rows, block_k, None if b is None else b.data_ptr(), y.data_ptr(), n, m, n,
                                     torch.get_num_threads())
    return y


def linear_silu_mul(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, scale_rows: int,
                    block_k: int) -> torch.Tensor:
    """silu(x W_g^T) * (x W_u^T) for data = [W_g; W_u] (2d rows): linear() then SiluAndMul's values."""
    n, k = data.shape
    x = _check(x, k)
    m, d = x.shape[0], n // 2
    y = torch.empty((m, d), dtype=torch.float32)
    if m > 0:
        cpu_ops.library().fp8_linear_silu_mul_f32(x.data_ptr(), x.stride(0), data.data_ptr(), k, scale.data_ptr(),
                                                  scale.stride(0), scale_rows, block_k, y.data_ptr(), d, m, d,
                                                  torch.get_num_threads())
    return y


def rows_route(rows: int) -> bool:
    """Whether `rows` rows take the GEMV route (each row the one-row GEMV's values) rather than the GEMM."""
    return rows <= ROWS_MAX
