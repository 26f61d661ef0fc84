"""MXFP4 checkpoints for tests: a saved HF gpt-oss model's expert stacks re-written as OpenAI's release stores
them -- `<experts>.gate_up_proj_blocks` / `_scales` and `down_proj_blocks` / `_scales` (uint8 e2m1 pairs and
e8m0 exponents, 32 values a block along each output row's inputs) with quantization_config
{"quant_method": "mxfp4"} -- so that HF transformers itself reads them back (dequantizing on the CPU)."""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from roofline.model_executor.layers.quantization.mxfp4 import BLOCK, E2M1_VALUES, SCALE_BIAS

# what the release's config says stays in high precision
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of 32) -> (blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32]): per
    block the smallest power of two 2^s with amax / 2^s <= 6, each value rounded to the nearest e2m1 value."""
    *lead, n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"the input dimension ({k}) is not a multiple of {BLOCK}")
    v = w.float().reshape(*lead, n, k // BLOCK, BLOCK)
    amax = v.abs().amax(dim=-1, keepdim=True)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-SCALE_BIAS, 127)
    q = v / torch.exp2(exp)
    table = torch.tensor(E2M1_VALUES[:8])  # the magnitudes; the sign is bit 3
    codes = (q.abs()[..., None] - table).abs().argmin(dim=-1) | ((q < 0).to(torch.int64) << 3)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp[..., 0] + SCALE_BIAS).to(torch.uint8).contiguous()


def write_mxfp4_checkpoint(src: str, dst: str, drop: tuple[str, ...] = ()) -> list[str]:
    """src: a save_pretrained gpt-oss directory.  Writes dst with every `*.experts.gate_up_proj` [E, H, 2I] and
    `*.experts.down_proj` [E, I, H] stored as MXFP4 blocks and scales of the transposed stack (the release's
    [E, out, in] order) and quantization_config in config.json; `drop`: tensor names left out (bad-input
    tests).  Returns the base names of the quantized stacks."""
    state = {}
    for f in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        state.update(load_file(f))
    out, names = {}, []
    for name, t in state.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2))
            names.append(name)
        else:
            out[name] = t
    for name in drop:
        del out[name]
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and not f.endswith(".index.json"):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2)
    return names
