"""GGUF block-quantized weights kept in their file format and multiplied natively on the CPU.

A `QuantizedTensor` is a 2-D weight [rows x cols] as a GGUF file stores it: each row cols/QK blocks of
one format (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), held as uint8 [rows x row_bytes].  Rows are whole
block runs, so the loaders' row operations (llama.cpp's Q/K row permutation undone, shards of a fused
QKV or gate/up projection placed at their row offsets) apply to the bytes as to fp32 rows.

`linear(x, weight, bias)` computes F.linear(x, dequantize(weight), bias) with the native kernels, which
expand blocks in registers to exactly gguf.quants.dequantize's values and accumulate in fp32: 1..8 rows
(`quant_rows_route` says which) by a GEMV that decodes each block once (every row the one-row GEMV's
values); more rows through the packed GEMM of cpu_kernels.c over panels expanded on the fly
(bit-identical to cpu_ops.gemm_packed over the dequantized weight).  With `quantize_activations` (--gguf-activations q8) Q4_0/Q4_1/Q8_0 blocks
multiply 8-bit activations instead (quant_kernels.c's QT_ACT_Q8): the tensor's bytes are re-laid in
place, sixteen rows interleaved, so one vpdpbusd takes four values of each of sixteen rows
(`interleave_rows`; `dequantize()` and `file_layout()` read through it).

Which formats and why: the default model's file is Q4_1 with a Q8_0 embedding; Q4_0 is the other
legacy 4-bit format; community "Q4_K_M" / "Q5_K_M" files mix Q4_K, Q5_K and Q6_K.  Other formats are
dequantized to fp32 by the loader, as before.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from roofline.config import GGUF_ACTIVATIONS
from roofline.cpu import ops as cpu_ops

# ggml type id -> (name, values per block, bytes per block), as in ggml.h / gguf.constants
FORMATS = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}

_P, _I = ctypes.c_void_p, ctypes.c_int64
cpu_ops.declare("quant_block_elems", [ctypes.c_int], _I)
cpu_ops.declare("quant_block_bytes", [ctypes.c_int], _I)
cpu_ops.declare("quant_dequantize_f32", [ctypes.c_int, _P, _I, _I, _I, _P, ctypes.c_int])
cpu_ops.declare("quant_linear_f32", [ctypes.c_int, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, ctypes.c_int])
cpu_ops.declare("quant_linear_silu_mul_f32", [ctypes.c_int, _P, _I, _P, _I, _P, _I, _I, _I, _I, ctypes.c_int])
cpu_ops.declare("quant_rows_route", [ctypes.c_int, _I], ctypes.c_int)  # 1: M rows take the GEMV routes


ACT_Q8_FLAG = 0x80  # quant_kernels.c's QT_ACT_Q8
ACT_Q8_FORMATS = (2, 3, 8)  # Q4_0, Q4_1, Q8_0: the formats with an integer dot product


def quantize_activations(model: torch.nn.Module, mode: str) -> int:
    """--gguf-activations: "q8" has every GGUF weight the model keeps in blocks (Q4_0, Q4_1, Q8_0) multiply
    8-bit activations; returns how many weights that covers."""
    if mode not in GGUF_ACTIVATIONS:
        raise ValueError(f"gguf_activations must be one of {', '.join(GGUF_ACTIVATIONS)}, got {mode!r}")
    n = 0
    for module in model.modules():
        q = getattr(module, "quant", None)
        if isinstance(q, QuantizedTensor):
            q.quantize_activations = mode == "q8"
            n += q.qtype in ACT_Q8_FORMATS and mode == "q8"
    return n


def format_name(qtype: int) -> str:
    return FORMATS[qtype][0] if qtype in FORMATS else f"ggml type {qtype}"


def supported(qtype: int) -> bool:
    """Whether the native kernels compute on this ggml type (else the loader dequantizes it)."""
    return qtype in FORMATS


@dataclass
class QuantizedTensor:
    """A [rows x cols] weight in GGUF blocks: data uint8 [rows x row_bytes] (contiguous), qtype a ggml id."""

    data: torch.Tensor
    qtype: int
    cols: int

    def __post_init__(self) -> None:
        if self.qtype not in FORMATS:
            raise ValueError(f"{format_name(self.qtype)} is not a format the native kernels take")
        _, qk, bb = FORMATS[self.qtype]
        if self.cols % qk or self.data.dtype != torch.uint8 or self.data.dim() != 2 \
                or self.data.shape[1] != self.cols // qk * bb:
            raise ValueError(f"a {format_name(self.qtype)} tensor of {self.cols} columns needs uint8 rows of "
                             f"{self.cols // qk * bb} bytes, got {self.data.dtype} {tuple(self.data.shape)}")
        self._act_q8 = False

    @property
    def quantize_activations(self) -> bool:
        """Whether the activations are quantized to 8 bits per 32 values for integer dot products with the
        blocks (quant_kernels.c, QT_ACT_Q8; set by the worker for --gguf-activations q8).  Only Q4_0, Q4_1
        and Q8_0 take it (setting it on another format leaves it off).  Setting it re-lays `data` in place
        for that mode's kernels, sixteen rows interleaved (`interleave_rows`); clearing it restores the file
        layout."""
        return self._act_q8

    @quantize_activations.setter
    def quantize_activations(self, on: bool) -> None:
        on = bool(on) and self.qtype in ACT_Q8_FORMATS
        if on != self._act_q8:
            self.data.copy_(torch.from_numpy((interleave_rows if on else deinterleave_rows)(self.data.numpy(),
                                                                                          self.qtype)))
            self._act_q8 = on

    def file_layout(self) -> torch.Tensor:
        """The blocks as the file lays them out (`data` itself unless re-laid for the q8 mode)."""
        return torch.from_numpy(deinterleave_rows(self.data.numpy(), self.qtype)) if self._act_q8 else self.data

    @classmethod
    def empty(cls, rows: int, cols: int, qtype: int) -> "QuantizedTensor":
        """Zeroed blocks (every value 0) for a loader to fill row ranges of."""
        return cls(torch.zeros((rows, row_bytes(qtype, cols)), dtype=torch.uint8), qtype, cols)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def format(self) -> str:
        return format_name(self.qtype)

    @property
    def kernel_type(self) -> int:
        """The type the kernels are called with: the ggml id, with the activation-quantized mode's bit."""
        return self.qtype | (ACT_Q8_FLAG if self.quantize_activations and self.qtype in ACT_Q8_FORMATS else 0)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """F.linear(x, dequantize(), bias) natively (the quantized-weight seam: layers/quantization)."""
        return linear(x, self, bias)

    def linear_silu_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        return linear_silu_mul(x, self)

    def rows_route(self, rows: int) -> bool:
        return rows_route(self.kernel_type, rows)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows x cols] by gguf's own dequantization (the reference, and the fallback)."""
        import gguf

        arr = gguf.quants.dequantize(self.file_layout().numpy(), gguf.GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(self.shape))


INTERLEAVE = 16  # quant_kernels.c X16: rows the q8 mode's layout interleaves


def _interleaved_shape(blocks: np.ndarray, qtype: int) -> tuple[int, int, int, int, int]:
    """(whole groups of 16 rows, blocks per row, bytes per block, header bytes per block: d and Q4_1's m,
    value chunks of 4 bytes per block)"""
    _, _, bb = FORMATS[qtype]
    return (blocks.shape[0] // INTERLEAVE, blocks.shape[1] // bb, bb, 4 if qtype == 3 else 2,
            8 if qtype == 8 else 4)


def interleave_rows(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """The q8 mode's layout (quant_kernels.c, "activation-quantized mode") of uint8 blocks [rows x row_bytes]
    of Q4_0 / Q4_1 / Q8_0: each whole group of 16 rows, block by block, as the 16 rows' fp16 d (then m),
    then chunks of 4 value bytes per row (Q8_0's values plus 128); rows past the last group unchanged."""
    g, nb, bb, head, chunks = _interleaved_shape(blocks, qtype)
    if g == 0:
        return blocks.copy()
    grouped = blocks[:g * INTERLEAVE].reshape(g, INTERLEAVE, nb, bb)
    scales = grouped[..., :head].reshape(g, INTERLEAVE, nb, head // 2, 2).transpose(0, 2, 3, 1, 4)
    values = grouped[..., head:]
    if qtype == 8:
        values = values ^ np.uint8(0x80)
    values = values.reshape(g, INTERLEAVE, nb, chunks, 4).transpose(0, 2, 3, 1, 4)
    out = blocks.copy()
    out[:g * INTERLEAVE] = np.concatenate([scales.reshape(g, nb, -1), values.reshape(g, nb, -1)],
                                          axis=2).reshape(g * INTERLEAVE, -1)
    return out


def deinterleave_rows(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """interleave_rows undone: the file's layout."""
    g, nb, bb, head, chunks = _interleaved_shape(blocks, qtype)
    if g == 0:
        return blocks.copy()
    grouped = blocks[:g * INTERLEAVE].reshape(g, nb, INTERLEAVE * bb)
    scales = grouped[..., :INTERLEAVE * head].reshape(g, nb, head // 2, INTERLEAVE, 2).transpose(0, 3, 1, 2, 4)
    values = grouped[..., INTERLEAVE * head:].reshape(g, nb, chunks, INTERLEAVE, 4).transpose(0, 3, 1, 2, 4)
    if qtype == 8:
        values = values ^ np.uint8(0x80)
    out = blocks.copy()
    out[:g * INTERLEAVE] = np.concatenate([scales.reshape(g, INTERLEAVE, nb, head),
                                           values.reshape(g, INTERLEAVE, nb, chunks * 4)],
                                          axis=3).reshape(g * INTERLEAVE, -1)
    return out


def row_bytes(qtype: int, cols: int) -> int:
    _, qk, bb = FORMATS[qtype]
    if cols % qk:
        raise ValueError(f"{format_name(qtype)} rows hold a multiple of {qk} values, not {cols}")
    return cols // qk * bb


def dequantize_native(weight: QuantizedTensor) -> torch.Tensor:
    """fp32 [rows x cols] by the kernels' own expansion (tests compare it with QuantizedTensor.dequantize)."""
    rows, cols = weight.shape
    out = torch.empty((rows, cols), dtype=torch.float32)
    blocks = weight.file_layout()
    cpu_ops.library().quant_dequantize_f32(weight.qtype, blocks.data_ptr(), blocks.shape[1], rows, cols,
                                           out.data_ptr(), torch.get_num_threads())
    return out


def _check_rows(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """x as the kernels take it: fp32 CPU rows [M x cols], unit stride (a lone row contiguous)."""
    if not cpu_ops.accepts(x) or x.dim() != 2 or x.shape[1] != weight.cols:
        raise ValueError(f"quantized linear takes fp32 CPU rows [M x {weight.cols}] with unit stride, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    return x.contiguous() if x.shape[0] == 1 else x


def linear(x: torch.Tensor, weight: QuantizedTensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight.dequantize(), bias) for fp32 CPU x [M x cols] (see the module doc)."""
    x = _check_rows(x, weight)
    m = x.shape[0]
    n = weight.data.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    if m == 0:
        return y
    b = None if bias is None else bias.contiguous()
    cpu_ops.library().quant_linear_f32(weight.kernel_type, x.data_ptr(), x.stride(0), weight.data.data_ptr(),
                                       weight.data.shape[1], None if b is None else b.data_ptr(), y.data_ptr(), n,
                                       m, weight.cols, n, torch.get_num_threads())
    return y


def linear_silu_mul(x: torch.Tensor, gate_up: QuantizedTensor) -> torch.Tensor:
    """silu(x W_g^T) * (x W_u^T) for gate_up = [W_g; W_u] (2d rows): the values of linear() followed by
    SiluAndMul, with the [M x 2d] projection never written where the rows take the packed GEMM."""
    x = _check_rows(x, gate_up)
    m, d = x.shape[0], gate_up.data.shape[0] // 2
    y = torch.empty((m, d), dtype=torch.float32)
    if m > 0:
        cpu_ops.library().quant_linear_silu_mul_f32(gate_up.kernel_type, x.data_ptr(), x.stride(0),
                                                    gate_up.data.data_ptr(), gate_up.data.shape[1], y.data_ptr(), d,
                                                    m, gate_up.cols, d, torch.get_num_threads())
    return y


def rows_route(kernel_type: int, rows: int) -> bool:
    """Whether `rows` rows of a weight of this kernel type take the GEMV routes, each row the one-row
    GEMV's values (quant_kernels.c's quant_rows_route), rather than the packed GEMM."""
    return bool(cpu_ops.library().quant_rows_route(kernel_type, rows))
