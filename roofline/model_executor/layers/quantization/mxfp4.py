"""MXFP4 weights (OpenAI's gpt-oss release format): the tensor, its dequantization, and the checkpoint reader.

A checkpoint stores an expert stack W [E, N, K] (N output rows, K inputs: gpt-oss's gate_up_proj has N = 2I,
gate and up rows interleaved, its down_proj N = H) as two tensors:
    <name>_blocks  uint8 [E, N, K/32, 16]: 32 e2m1 values a block, two a byte (the even-indexed value in the
                   low nibble, the odd one in the high nibble)
    <name>_scales  uint8 [E, N, K/32]: one e8m0 exponent a block, bias 127
and a weight is e2m1(nibble) * 2^(scale - 127).  HF transformers keeps the dequantized stack transposed,
[E, K, N] (GptOssExperts' gate_up_proj [E, H, 2I] and down_proj [E, I, H]), and so does the reader here:
a checkpoint stored dequantized (bf16 releases, save_pretrained) and an MXFP4 one reach the model as the
same tensors under the same names.

There is no native MXFP4 compute yet: `mxfp4_checkpoint_weights` dequantizes at load to the model dtype --
with --quantized-weights native too (the worker logs it) -- computing in that dtype as HF's
`convert_moe_packed_tensors` does (an e2m1 table lookup, then ldexp by the exponent), so the values are
HF's.  A `_blocks` tensor without its `_scales` (or the reverse), a shape that does not pair up, or a NaN
exponent (255) is a ValueError naming the tensor.

llama.cpp's GGUF files (type MXFP4, 39) hold the same blocks repacked: per block of 32 an exponent byte, then 16
bytes whose low nibble is value j and high nibble value j + 16 (ggml's Q4_0-style order; the converter swaps
the nibbles of HF's even / odd pairs into it).  `from_ggml` turns those bytes back into HF's blocks and scales,
so a GGUF file's experts dequantize through the same code to the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F

from roofline.model_executor.layers.quantization import Mxfp4Config

FORMAT = "mxfp4"
BLOCK = 32  # values per block (one exponent each)
SCALE_BIAS = 127
# e2m1: sign bit 3, exponent bits 2-1, mantissa bit 0 -> the value of each of the 16 codes
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
_CHUNK_ROWS = 1 << 20  # blocks dequantized at a time (bounds the index tensors' memory)


@dataclass
class Mxfp4Tensor:
    blocks: torch.Tensor  # uint8 [..., N, K/32, 16]
    scales: torch.Tensor  # uint8 [..., N, K/32]

    def __post_init__(self) -> None:
        b, s = self.blocks, self.scales
        if b.dtype != torch.uint8 or b.dim() < 3 or b.shape[-1] != BLOCK // 2:
            raise ValueError(f"MXFP4 blocks must be uint8 [..., rows, blocks, {BLOCK // 2}], got {b.dtype} "
                             f"{list(b.shape)}")
        if s.dtype != torch.uint8 or tuple(s.shape) != tuple(b.shape[:-1]):
            raise ValueError(f"MXFP4 scales for blocks {list(b.shape)} must be uint8 {list(b.shape[:-1])}, got "
                             f"{s.dtype} {list(s.shape)}")
        if (s == 255).any():
            raise ValueError("MXFP4 scales hold the e8m0 NaN exponent (255)")

    # ---- what every quantized weight answers (quantization/__init__.py) --------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """[..., N, K]: the dequantized weight's shape (rows by inputs)."""
        return (*self.blocks.shape[:-2], self.blocks.shape[-2] * BLOCK)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()

    @property
    def format(self) -> str:
        return FORMAT

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[..., N, K] in `dtype`: e2m1 value * 2^(exponent - 127), computed in `dtype` as HF does."""
        lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=self.blocks.device)
        rows = self.blocks.reshape(-1, BLOCK // 2)
        exponents = self.scales.reshape(-1, 1)
        out = torch.empty(rows.shape[0], BLOCK, dtype=dtype, device=self.blocks.device)
        for r0 in range(0, rows.shape[0], _CHUNK_ROWS):
            blk, sub = rows[r0:r0 + _CHUNK_ROWS], out[r0:r0 + _CHUNK_ROWS]
            sub[:, 0::2] = lut[(blk & 0x0F).to(torch.int)]
            sub[:, 1::2] = lut[(blk >> 4).to(torch.int)]
            torch.ldexp(sub, exponents[r0:r0 + _CHUNK_ROWS].to(torch.int32) - SCALE_BIAS, out=sub)
        return out.view(self.shape)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """F.linear(x, dequantize(), bias) (no native route: the dequantized weight)."""
        return F.linear(x, self.dequantize(x.dtype), bias)

    def linear_silu_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    def rows_route(self, rows: int) -> bool:
        return False


GGML_BLOCK_BYTES = 1 + BLOCK // 2  # the exponent, then 16 bytes of nibbles


def from_ggml(raw: torch.Tensor) -> Mxfp4Tensor:
    """ggml's MXFP4 rows, uint8 [..., N, K/32 * 17] (each block: exponent byte, 16 bytes with value j in the low
    nibble of byte j and value j + 16 in its high nibble), as HF's blocks [..., N, K/32, 16] (values 2j / 2j + 1
    in the low / high nibble of byte j) and scales [..., N, K/32]."""
    if raw.dtype != torch.uint8 or raw.dim() < 2 or raw.shape[-1] % GGML_BLOCK_BYTES:
        raise ValueError(f"ggml MXFP4 rows must be uint8 [..., rows, blocks x {GGML_BLOCK_BYTES}], got {raw.dtype} "
                         f"{list(raw.shape)}")
    b = raw.reshape(*raw.shape[:-1], raw.shape[-1] // GGML_BLOCK_BYTES, GGML_BLOCK_BYTES)
    qs = b[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # value order 0..31
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return Mxfp4Tensor(blocks.contiguous(), b[..., 0].contiguous())


# ---- reading a checkpoint ---------------------------------------------------------------------------------

def _joined(base: str, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense stack HF keeps for <base>: dequantized [E, N, K] transposed to [E, K, N]."""
    if blocks.dim() != 4:
        raise ValueError(f"checkpoint tensor {base + BLOCKS_SUFFIX!r}: MXFP4 expert blocks must be uint8 "
                         f"[experts, rows, blocks, {BLOCK // 2}], got {blocks.dtype} {list(blocks.shape)}")
    try:
        t = Mxfp4Tensor(blocks, scales)
    except ValueError as e:
        raise ValueError(f"checkpoint tensors {base + BLOCKS_SUFFIX!r} / {base + SCALES_SUFFIX!r}: {e}") from e
    return t.dequantize(dtype).transpose(1, 2)


def mxfp4_checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg: Mxfp4Config,
                             dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of an MXFP4 checkpoint: each `<m>_blocks` joined with its `<m>_scales` (in any order, any
    shard) as `<m>`, dequantized to `dtype` in HF's layout (module doc); every other tensor as it comes.  A
    blocks tensor without its scales or the reverse is a ValueError naming the tensor."""
    blocks_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    for name, t in weights:
        if name.endswith(BLOCKS_SUFFIX):
            base = name[: -len(BLOCKS_SUFFIX)]
            if base in scales_waiting:
                yield base, _joined(base, t, scales_waiting.pop(base), dtype)
            else:
                blocks_waiting[base] = t
        elif name.endswith(SCALES_SUFFIX):
            base = name[: -len(SCALES_SUFFIX)]
            if base in blocks_waiting:
                yield base, _joined(base, blocks_waiting.pop(base), t, dtype)
            else:
                scales_waiting[base] = t
        else:
            yield name, t
    if blocks_waiting:
        base = sorted(blocks_waiting)[0]
        raise ValueError(f"checkpoint tensor {base + BLOCKS_SUFFIX!r} is MXFP4 but {base + SCALES_SUFFIX!r} is missing")
    if scales_waiting:
        base = sorted(scales_waiting)[0]
        raise ValueError(f"checkpoint tensor {base + SCALES_SUFFIX!r} has no MXFP4 blocks {base + BLOCKS_SUFFIX!r}")
