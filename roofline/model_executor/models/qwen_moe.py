"""Qwen2-MoE (Qwen2MoeForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM).

Layer i's FFN is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, else
a dense SwiGLU MLP of width intermediate_size.  A sparse block routes softmax top-k over num_experts
experts of width moe_intermediate_size (norm_topk_prob renormalizes the chosen weights); Qwen2-MoE adds
a shared expert of width shared_expert_intermediate_size scaled per token by
sigmoid(shared_expert_gate(x)).  Under tensor parallelism the experts and the shared expert return
partial sums and the block all-reduces once.  Attention: Qwen2-MoE has q/k/v biases (qkv_bias),
Qwen3-MoE per-head q/k RMSNorm.
"""

from __future__ import annotations

from torch import nn

from roofline.model_executor.models.llama import LlamaMLP
from roofline.model_executor.models.llama_moe import LlamaMoeForCausalLM, SparseMoeBlock


def is_sparse_layer(config, layer_idx: int) -> bool:
    """HF Qwen-MoE's rule for which layers hold experts."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and (getattr(config, "num_experts", 0) or 0) > 0 and (layer_idx + 1) % step == 0)


class Qwen2MoeForCausalLM(LlamaMoeForCausalLM):
    o_bias_follows_qkv = False

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "qkv_bias", True))  # transformers < 5 configs have no field: always on

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config)
        return SparseMoeBlock(config, "moe_intermediate_size",
                              getattr(config, "shared_expert_intermediate_size", 0) or 0)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = True
    o_bias_follows_qkv = True

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", False))
