"""Quantized weights behind one seam: GGUF blocks, FP8 blocks, MXFP4 expert blocks (gpt-oss).

A quantized weight is an object a linear layer keeps in `quant` instead of a dense `weight` (which becomes
a meta tensor).  Every kind answers the same calls:
    shape, nbytes, format        [N, K]; bytes held (scales included); the name weight_bytes_by_format shows
    dequantize()                 the dense fp32 weight (the reference, and the dequantize-at-load route)
    linear(x, bias)              F.linear(x, dequantize(), bias) by the kind's native route
    linear_silu_mul(x)           silu(x W_g^T) * (x W_u^T) fused, or None (the caller projects, then SiluAndMul)
    rows_route(rows)             whether `rows` rows take the per-row (GEMV) route: LlamaModel keeps a batch's
                                 rows only where they come out the same bits as in the whole batch
Kinds:
    gguf        roofline/cpu/gguf_quant.QuantizedTensor (llama.cpp's blocks; the CPU's native kernels)
    fp8 blocks  fp8.Fp8BlockTensor (DeepSeek-V3's e4m3 weights with [128, 128] block scales; the CPU's native
                kernels, Triton on CUDA)
    mxfp4       mxfp4.Mxfp4Tensor (gpt-oss's expert stacks: e2m1 pairs a byte, an e8m0 exponent per 32 values);
                no native route yet: dequantized at load to the model dtype, HF's values, whatever the switch
One switch decides native vs dequantize-at-load for every kind: EngineConfig.quantized_weights
(--quantized-weights native|dequantize).  `checkpoint_quantization(hf_config)` reads and checks a checkpoint's
`quantization_config`, failing at start-up with the field named; each kind's checkpoint reader (fp8.py's
fp8_checkpoint_weights, mxfp4.py's mxfp4_checkpoint_weights) joins the stored tensors with their scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

SUPPORTED_METHODS = ("fp8", "mxfp4")


@dataclass(frozen=True)
class Fp8BlockConfig:
    """DeepSeek-V3's FP8 recipe: e4m3 weights, a fp32 `weight_scale_inv` per [block_n x block_k] block,
    activations quantized dynamically (per token and 1 x block_k group) where the GEMM runs in FP8."""

    block_n: int
    block_k: int
    ignored: tuple[str, ...] = ()  # modules_to_not_convert / ignored_layers: stored in high precision

    @property
    def scale_bytes_per_weight(self) -> float:
        return 4.0 / (self.block_n * self.block_k)


@dataclass(frozen=True)
class Mxfp4Config:
    """OpenAI's MXFP4 release format (gpt-oss): expert projections stored as `<name>_blocks` (uint8, two e2m1
    values a byte, 32 values a block) and `<name>_scales` (uint8 e8m0 exponents, bias 127); everything else in
    high precision (`modules_to_not_convert`)."""

    ignored: tuple[str, ...] = ()


def _field(q: Any, name: str, default=None):
    return q.get(name, default) if isinstance(q, dict) else getattr(q, name, default)


def checkpoint_quantization(hf_config) -> Optional[Fp8BlockConfig | Mxfp4Config]:
    """The checkpoint's quantization (None: plain weights), or ValueError naming the field we cannot honour."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    if not isinstance(q, dict) and hasattr(q, "to_dict"):
        q = q.to_dict()
    method = _field(q, "quant_method")
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (supported: fp8: "
                         "DeepSeek-style FP8 blocks; mxfp4: gpt-oss's MXFP4 experts)")
    if method == "mxfp4":
        return _mxfp4_config(q)
    fmt = _field(q, "fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (only e4m3)")
    scheme = _field(q, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported (only dynamic: "
                         "activations quantized per token group at run time)")
    block = _field(q, "weight_block_size")
    if block is None:
        raise ValueError("quantization_config.weight_block_size is missing: per-tensor FP8 checkpoints are not "
                         "supported (only block scales, e.g. [128, 128])")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two positive integers [block_n, block_k], "
                         f"got {block!r}")
    if block[1] % 16:
        raise ValueError(f"quantization_config.weight_block_size [{block[0]}, {block[1]}]: block_k must be a "
                         "multiple of 16")
    ignored = tuple(_field(q, "modules_to_not_convert", None) or ()) + tuple(_field(q, "ignored_layers", None) or ())
    return Fp8BlockConfig(int(block[0]), int(block[1]), ignored)


def _mxfp4_config(q: Any) -> Mxfp4Config:
    ignored = _field(q, "modules_to_not_convert", None)
    if ignored is not None and (not isinstance(ignored, (list, tuple)) or not all(isinstance(m, str) for m in ignored)):
        raise ValueError(f"quantization_config.modules_to_not_convert must be a list of module names, got {ignored!r}")
    dequantize = _field(q, "dequantize", False)
    if not isinstance(dequantize, bool):
        raise ValueError(f"quantization_config.dequantize must be true or false, got {dequantize!r}")
    return Mxfp4Config(tuple(ignored or ()))


def blocks(n: int, b: int) -> int:
    return math.ceil(n / b)


QUANT_ATTRS = ("quant", "w13_quant", "w2_quant")  # where modules keep quantized weights (linear layers, expert stacks)


def is_quantized(t) -> bool:
    """A quantized weight of any kind (it dequantizes)."""
    return hasattr(t, "dequantize") and not isinstance(t, torch.Tensor)


def quantized_tensors(model: torch.nn.Module) -> list:
    """Every quantized weight the model's modules keep (linear layers' `quant`, expert stacks)."""
    out = []
    for module in model.modules():
        for attr in QUANT_ATTRS:
            t = getattr(module, attr, None)
            if t is not None and is_quantized(t):
                out.append(t)
    return out


def weight_bytes_by_format(model: torch.nn.Module) -> dict[str, int]:
    """The bytes a model's weights occupy as its layers compute on them, by format ("Q4_1", "fp8_e4m3",
    "float32", ...): blocks where a module keeps them (scales included), every other parameter once (tied ones
    once; meta ones, standing in for kept blocks, hold nothing); packed copies and caches not counted."""
    out: dict[str, int] = {}
    for q in quantized_tensors(model):
        out[q.format] = out.get(q.format, 0) + q.nbytes
    seen: set[int] = set()
    for p in model.parameters():
        if p.device.type != "meta" and id(p) not in seen:
            seen.add(id(p))
            name = str(p.dtype).replace("torch.", "")
            out[name] = out.get(name, 0) + p.numel() * p.element_size()
    return out
