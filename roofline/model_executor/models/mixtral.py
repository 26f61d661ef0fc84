"""Mixtral (MixtralForCausalLM): Llama attention; every layer's FFN is a sparse mixture of
num_local_experts SwiGLU experts of width intermediate_size, softmax top-k routing
(num_experts_per_tok) with the chosen weights renormalized.  Checkpoints name the block
`block_sparse_moe` and the experts' projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from torch import nn

from roofline.model_executor.models.llama_moe import LlamaMoeForCausalLM, SparseMoeBlock


class MixtralForCausalLM(LlamaMoeForCausalLM):
    renamed_modules = {".block_sparse_moe.": ".mlp."}

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config, "intermediate_size")
