"""Phi-3 / Phi-3.5 / Phi-4 text models (Phi3ForCausalLM), as HF transformers computes them.

The layer is Llama's (pre-norm RMSNorm, GQA attention with rotate-half rope, SwiGLU MLP, no biases), so
the Llama modules (and on the CPU the fp32 layer stack) run it unchanged.  What this module owns:

  * the checkpoint's fused projections: `self_attn.qkv_proj.weight` holds the q, k and v rows stacked and
    `mlp.gate_up_proj.weight` the gate rows then the up rows.  Each is cut into its parts at load and each
    part loaded as that shard of QKVParallelLinear / MergedColumnParallelLinear, so every tensor-parallel
    rank takes its own heads and its own slice of gate and up;
  * the config's reading: LongRoPE (`rope_type` 'longrope', layers/rotary.py: the factors are chosen once
    from the config, see there) with `partial_rotary_factor` (Phi-4-mini), and `sliding_window`, one
    window for every layer as HF masks it (Phi-3-mini-4k: 2047), read by llama.layer_sliding_window like every
    Llama-family window (one no shorter than max_position_embeddings masks nothing and is ignored).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import nn

from roofline.attention.backend import AttentionBackend
from roofline.model_executor.layers.quantization import is_quantized
from roofline.model_executor.layers.quantization.fp8 import Fp8BlockTensor
from roofline.model_executor.layers.linear import LinearBase
from roofline.model_executor.models.llama import LlamaForCausalLM, load_into_linear


def split_rows(tensor, sizes: list[int]) -> list:
    """A checkpoint tensor [sum(sizes), ...] cut into consecutive row ranges of `sizes` rows.  FP8 blocks
    stay FP8 with one scale row per weight row (a cut may fall inside a block of rows); other quantized
    formats are dequantized first."""
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"{tensor.shape[0]} rows, expected {' + '.join(map(str, sizes))} = {sum(sizes)}")
    if isinstance(tensor, Fp8BlockTensor):
        scales, parts, start = tensor.row_scales(), [], 0
        for n in sizes:
            parts.append(replace(tensor, data=tensor.data[start:start + n], scale=scales[start:start + n],
                                 scale_rows=1))
            start += n
        return parts
    if is_quantized(tensor):
        tensor = tensor.dequantize()
    return list(tensor.split(sizes, dim=0))


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, backend: AttentionBackend):
        super().__init__(config, backend)  # sliding_window: LlamaAttention's (llama.layer_sliding_window)
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        # checkpoint fragment -> the parts it stacks: (shard id, rows)
        self.fused_params = {
            ".self_attn.qkv_proj.": [("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)],
            ".mlp.gate_up_proj.": [(0, config.intermediate_size), (1, config.intermediate_size)],
        }

    def _load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> Optional[str]:
        """A fused qkv_proj / gate_up_proj tensor is cut into its parts, each loaded as its shard (this rank's
        slice of it); anything else as in Llama."""
        for frag, parts in self.fused_params.items():
            if frag not in name:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            try:
                pieces = split_rows(tensor, [rows for _, rows in parts])
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            for (shard, _), piece in zip(parts, pieces):
                if isinstance(owner, LinearBase) and name.endswith(".weight"):
                    load_into_linear(owner, name, piece, shard)
                else:  # a bias
                    p = params[name]
                    owner.weight_loader(p, piece.to(p.dtype), shard)
            return name
        return super()._load_tensor(name, tensor, params)
