"""FP8 block weights (DeepSeek-V3/R1's checkpoints): the tensor a layer keeps, and the checkpoint reader.

A checkpoint stores a projection's weight as e4m3 [N x K] and `<name>_scale_inv` fp32 [ceil(N/bn) x
ceil(K/bk)] (bn x bk = `weight_block_size`, [128, 128]; partial blocks at the edges are normal): the weight's
value is e4m3(w) * scale of its block, rounded once in fp32.

`Fp8BlockTensor` holds the bytes as they come (uint8, one byte per weight) and the scales with `scale_rows`
weight rows per scale row: the checkpoint's bn where a layer's rows line up with the blocks, 1 (a scale per
row) while a layer is assembled from shards (fused qkv / gate-up, tensor-parallel slices that cut a block,
expert stacks) -- `compact()` folds them back after loading where the rows allow.  Columns keep the
checkpoint's bk blocks: a tensor-parallel shard of the input dimension must start and end on a block
boundary (else a start-up error naming the layer and the sizes).

`linear` runs where x lives: the CPU's native kernels (roofline/cpu/fp8_quant.py; values equal the dequantized
weight through the same route, bit for bit), Triton on CUDA (fp8_triton.py: W8A8 with per-token-group
activation scales where the GPU has FP8 units, weight-only otherwise), else dequantize-then-F.linear.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F

from roofline.cpu import fp8_quant, ops as cpu_ops
from roofline.model_executor.layers.quantization import Fp8BlockConfig, blocks, quantized_tensors

FORMAT = "fp8_e4m3"
FP8_GEMMS = ("auto", "w8a8", "weight_only")  # the CUDA route (fp8_triton.block_fp8_linear's mode)


@dataclass
class Fp8BlockTensor:
    data: torch.Tensor  # uint8 [..., N, K]: e4m3 bytes
    scale: torch.Tensor  # fp32 [..., ceil(N / scale_rows), ceil(K / block_k)]
    scale_rows: int  # weight rows per scale row
    block_k: int  # weight columns per scale column
    block_n: int = 0  # the checkpoint's block height (what compact() folds per-row scales back to); 0: scale_rows
    gemm: str = "auto"  # CUDA: auto | w8a8 | weight_only

    def __post_init__(self) -> None:
        if self.data.dtype == torch.float8_e4m3fn:
            self.data = self.data.view(torch.uint8)
        if self.data.dtype != torch.uint8 or self.data.dim() < 2:
            raise ValueError(f"FP8 block weight must be e4m3 bytes [N x K], got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")
        if not self.block_n:
            self.block_n = self.scale_rows
        want = (*self.data.shape[:-2], blocks(self.data.shape[-2], self.scale_rows),
                blocks(self.data.shape[-1], self.block_k))
        if tuple(self.scale.shape) != want or self.scale.dtype != torch.float32:
            raise ValueError(f"FP8 block scales for a weight {list(self.data.shape)} in [{self.scale_rows}, "
                             f"{self.block_k}] blocks must be float32 {list(want)}, got {self.scale.dtype} "
                             f"{list(self.scale.shape)}")

    # ---- what every quantized weight answers (quantization/__init__.py) --------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel() * 4

    @property
    def format(self) -> str:
        return FORMAT

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self) -> torch.Tensor:
        """fp32 [..., N, K]: e4m3 value x block scale (torch: the reference)."""
        if self.data.dim() == 2:
            return fp8_quant.dequantize_reference(self.data, self.scale, self.scale_rows, self.block_k)
        return torch.stack([self[i].dequantize() for i in range(self.data.shape[0])])

    def _cpu_native(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype == torch.float32 and self.data.dim() == 2 and cpu_ops.available()

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """F.linear(x, dequantize(), bias) for x [..., K]."""
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)
        if x.is_cuda:
            from roofline.model_executor.layers.quantization.fp8_triton import block_fp8_linear

            y = block_fp8_linear(rows, self.data, self.scale, self.block_k, self.scale_rows, bias, mode=self.gemm)
        elif self._cpu_native(rows):
            y = fp8_quant.linear(rows if rows.stride(-1) == 1 else rows.contiguous(), self.data, self.scale,
                                 self.scale_rows, self.block_k, bias)
        else:
            y = F.linear(rows, self.dequantize().to(x.dtype), bias)
        return y.reshape(*lead, self.data.shape[-2])

    def linear_silu_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """silu(x W_g^T) * (x W_u^T) for [W_g; W_u] natively on the CPU (fused in the GEMM route); None elsewhere."""
        if not self._cpu_native(x) or x.dim() != 2 or x.stride(-1) != 1:
            return None
        return fp8_quant.linear_silu_mul(x, self.data, self.scale, self.scale_rows, self.block_k)

    def rows_route(self, rows: int) -> bool:
        return fp8_quant.rows_route(rows)

    # ---- assembling a layer's weight from checkpoint shards ----------------------------------------------
    def __getitem__(self, i: int) -> "Fp8BlockTensor":
        """One matrix of a stack [E, N, K] (an expert's)."""
        return replace(self, data=self.data[i], scale=self.scale[i])

    @classmethod
    def empty(cls, shape: tuple[int, ...], block_k: int, block_n: int, device=None) -> "Fp8BlockTensor":
        """Zero weights (scale 1 per row) for loaders to fill rows of: scale_rows 1 until compact()."""
        *lead, n, k = shape
        return cls(torch.zeros(shape, dtype=torch.uint8, device=device),
                   torch.ones((*lead, n, blocks(k, block_k)), dtype=torch.float32, device=device), 1, block_k,
                   block_n)

    def row_scales(self) -> torch.Tensor:
        """The scales with one row per weight row: [..., N, ceil(K / block_k)]."""
        if self.scale_rows == 1:
            return self.scale
        return self.scale.repeat_interleave(self.scale_rows, dim=-2)[..., :self.data.shape[-2], :]

    def compact(self) -> None:
        """Per-row scales back to one row per block_n weight rows where every block's rows agree."""
        if self.scale_rows != 1 or self.block_n <= 1:
            return
        n, bn = self.data.shape[-2], self.block_n
        folded = self.scale[..., ::bn, :]
        if torch.equal(folded.repeat_interleave(bn, dim=-2)[..., :n, :], self.scale):
            self.scale, self.scale_rows = folded.contiguous(), bn

    def to(self, device) -> "Fp8BlockTensor":
        return replace(self, data=self.data.to(device), scale=self.scale.to(device))


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 weight_scale_inv [ceil(N/bn), ceil(K/bk)]) by DeepSeek's recipe: each
    block's scale is its amax / 448 (1 for an all-zero block).  For tests and benchmarks that write FP8 block
    checkpoints from dense weights."""
    bn, bk = block
    n, k = w.shape
    rows, cols = blocks(n, bn), blocks(k, bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    tiles = padded.view(rows, bn, cols, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / fp8_quant.E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-fp8_quant.E4M3_MAX, fp8_quant.E4M3_MAX)
    return q.view(rows * bn, cols * bk)[:n, :k].to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


# ---- reading a checkpoint ---------------------------------------------------------------------------------

SCALE_SUFFIX = "_scale_inv"
_UNSUPPORTED_SCALES = (".weight_scale", ".input_scale", ".activation_scale")


def _make(name: str, weight: torch.Tensor, scale: torch.Tensor, cfg: Fp8BlockConfig) -> Fp8BlockTensor:
    if weight.dim() != 2:
        raise ValueError(f"checkpoint tensor {name!r}: an FP8 weight must be 2-D, got {list(weight.shape)}")
    n, k = weight.shape
    want = [blocks(n, cfg.block_n), blocks(k, cfg.block_k)]
    if list(scale.shape) != want:
        raise ValueError(f"checkpoint tensor {name + SCALE_SUFFIX!r} has shape {list(scale.shape)}; a weight "
                         f"{[n, k]} in [{cfg.block_n}, {cfg.block_k}] blocks (quantization_config.weight_block_size) "
                         f"needs {want}")
    scale = scale.to(torch.float32)
    if not torch.isfinite(scale).all() or (scale.abs() > 2.0 ** 100).any():
        raise ValueError(f"checkpoint tensor {name + SCALE_SUFFIX!r} holds a non-finite or out-of-range scale")
    data = weight.view(torch.uint8)
    if ((data & 0x7F) == 0x7F).any():
        raise ValueError(f"checkpoint tensor {name!r} holds e4m3 NaN bytes")
    return Fp8BlockTensor(data, scale.contiguous(), cfg.block_n, cfg.block_k)


def fp8_checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg: Fp8BlockConfig,
                           keep: bool) -> Iterator[tuple[str, object]]:
    """(name, tensor) of a block-FP8 checkpoint: each e4m3 `<m>.weight` joined with its `<m>.weight_scale_inv`
    (in any order, any shard) as an Fp8BlockTensor -- or, without `keep`, its dequantized fp32 weight; every
    other tensor as it comes.  A weight without its scale, a scale without its weight, or a per-tensor scale
    is a ValueError naming the tensor."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}

    def joined(name: str, w: torch.Tensor, s: torch.Tensor):
        t = _make(name, w, s, cfg)
        return name, (t if keep else t.dequantize())

    for name, t in weights:
        if name.endswith(".weight" + SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in weights_waiting:
                yield joined(base, weights_waiting.pop(base), t)
            else:
                scales_waiting[base] = t
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if t.dtype != torch.float8_e4m3fn:
                raise ValueError(f"checkpoint tensor {name!r} is {t.dtype}, not e4m3 (quantization_config.fmt)")
            if name in scales_waiting:
                yield joined(name, t, scales_waiting.pop(name))
            else:
                weights_waiting[name] = t
        elif name.endswith(_UNSUPPORTED_SCALES):
            raise ValueError(f"checkpoint tensor {name!r}: per-tensor FP8 scales are not supported (only block "
                             "scales, <name>.weight_scale_inv)")
        else:
            yield name, t
    if weights_waiting:
        name = sorted(weights_waiting)[0]
        raise ValueError(f"checkpoint tensor {name!r} is FP8 but {name + SCALE_SUFFIX!r} is missing")
    if scales_waiting:
        name = sorted(scales_waiting)[0]
        raise ValueError(f"checkpoint tensor {name + SCALE_SUFFIX!r} has no FP8 weight {name!r}")


def set_gemm(model: torch.nn.Module, mode: str) -> int:
    """--fp8-gemm: the CUDA route of every FP8 block weight the model keeps; returns how many."""
    if mode not in FP8_GEMMS:
        raise ValueError(f"fp8_gemm must be one of {', '.join(FP8_GEMMS)}, got {mode!r}")
    n = 0
    for t in quantized_tensors(model):
        if isinstance(t, Fp8BlockTensor):
            t.gemm = mode
            n += 1
    return n


def compact_scales(model: torch.nn.Module) -> None:
    """After loading: fold per-row FP8 scales back into blocks where the rows line up (Fp8BlockTensor.compact)."""
    for t in quantized_tensors(model):
        if isinstance(t, Fp8BlockTensor):
            t.compact()
