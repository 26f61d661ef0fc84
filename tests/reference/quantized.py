"""GGUF-quantized test weights: blocks of every format the native kernels take, and tiny HF checkpoints
whose layer weights come to the engine as gguf_quant.QuantizedTensor (as a GGUF file's would)."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from roofline.cpu.gguf_quant import FORMATS, QuantizedTensor

# byte offsets of each format's fp16 scale fields inside a block (the rest: quants and packed scales)
HALF_FIELDS = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
QUANTIZABLE = (2, 3, 8)  # formats gguf's Python package can quantize (the K-quants it only dequantizes)


def random_blocks(qtype: int, rows: int, cols: int, seed: int, scale: float = 0.02) -> QuantizedTensor:
    """Blocks of random bytes (every quant and packed-scale pattern) with finite fp16 scales ~ scale,
    some of them fp16 subnormals, some negative."""
    rng = np.random.default_rng(seed)
    _, qk, bb = FORMATS[qtype]
    blocks = rng.integers(0, 256, size=(rows * (cols // qk), bb), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        s = (rng.standard_normal(blocks.shape[0]) * scale).astype(np.float16)
        s[::7] = np.float16(3e-6)  # an fp16 subnormal
        blocks[:, off:off + 2] = s.view(np.uint8).reshape(-1, 2)
    return QuantizedTensor(torch.from_numpy(blocks.reshape(rows, -1).copy()), qtype, cols)


def quantize(w: torch.Tensor, qtype: int, seed: int = 0) -> QuantizedTensor:
    """A 2-D weight in blocks of qtype: gguf's own quantization where it has one, else (K-quants) random
    blocks of a similar magnitude (the values then differ from w; callers use the blocks' values)."""
    rows, cols = w.shape
    if qtype in QUANTIZABLE:
        raw = gguf.quants.quantize(w.detach().float().numpy(), gguf.GGMLQuantizationType(qtype))
        return QuantizedTensor(torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1)), qtype, cols)
    return random_blocks(qtype, rows, cols, seed, scale=float(w.abs().mean()) / 40)


def quantized_layer_weights(hf_model, qtype: int) -> dict[str, QuantizedTensor]:
    """HF name -> blocks for every 2-D decoder-layer weight of hf_model (what a GGUF file quantizes);
    hf_model's parameters are set to the blocks' values, so it stays the reference."""
    out = {}
    with torch.no_grad():
        for i, (name, p) in enumerate(hf_model.named_parameters()):
            if name.startswith("model.layers.") and name.endswith(".weight") and p.dim() == 2:
                q = quantize(p, qtype, seed=i)
                out[name] = q
                p.copy_(q.dequantize())
    return out


def serve_blocks(monkeypatch, blocks: dict[str, QuantizedTensor]) -> None:
    """Make the worker read `blocks` in place of those tensors of a safetensors checkpoint, as
    gguf_weights(keep_quantized=True) hands them over."""
    from roofline.worker import worker

    real = worker.safetensors_weights

    def weights(path, show_progress=True):
        for name, t in real(path, show_progress):
            yield name, blocks.get(name, t)

    monkeypatch.setattr(worker, "safetensors_weights", weights)


def q8_emulation(x: torch.Tensor, w: QuantizedTensor, bias=None) -> torch.Tensor:
    """The activation-quantized mode's arithmetic in float64: x rounded per 32 values to llama.cpp's Q8_1
    (d = max|x| / 127, q = round(x * (1 / d)) ties to even, in fp32), times the exact weight values."""
    m, cols = x.shape
    blocks = x.reshape(m, cols // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)
    xq = (q.double() * d.double()).reshape(m, cols)
    y = xq @ w.dequantize().double().T
    return (y + bias.double() if bias is not None else y).float()
