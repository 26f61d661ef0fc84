"""Block-FP8 checkpoints for tests: a saved HF model's projections quantized to e4m3 with DeepSeek-V3's
`weight_scale_inv` block scales, and beside it the same model with those weights dequantized in fp32 (what HF
transformers runs as the reference)."""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from roofline.cpu.fp8_quant import dequantize_reference
from roofline.model_executor.layers.quantization.fp8 import quantize_fp8_blocks as quantize_blocks  # noqa: F401


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """What the engine computes on: e4m3 value x block scale in fp32 (fp8_quant.dequantize_reference)."""
    return dequantize_reference(q, scale, block[0], block[1])


def is_projection(name: str) -> bool:
    """The weights DeepSeek-V3's checkpoints store in FP8: every attention and MLP projection (experts and
    shared experts included); not the router gate, norms, embeddings or the LM head."""
    return name.endswith(".weight") and "proj" in name.rsplit(".", 2)[-2]


def write_fp8_checkpoint(src: str, fp8_dir: str, ref_dir: str, block=(128, 128), quantize=is_projection,
                         extra_config: dict | None = None) -> list[str]:
    """src: a save_pretrained directory.  Writes fp8_dir (e4m3 + scales, quantization_config in config.json)
    and ref_dir (the same weights dequantized, fp32); returns the quantized tensors' names."""
    state = {}
    for f in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        state.update(load_file(f))
    fp8, ref, names = {}, {}, []
    for name, t in state.items():
        if t.dim() == 2 and quantize(name):
            q, s = quantize_blocks(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            ref[name] = dequantize_blocks(q, s, block)
            names.append(name)
        else:
            fp8[name] = ref[name] = t
    for d, tensors in ((fp8_dir, fp8), (ref_dir, ref)):
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(src):
            if not f.endswith(".safetensors") and not f.endswith(".index.json"):
                shutil.copy(os.path.join(src, f), os.path.join(d, f))
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(fp8_dir, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = dict({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": list(block)}, **(extra_config or {}))
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2)
    return names
