"""Llama-family decoders whose feed-forward blocks are mixtures of experts (Mixtral, Qwen2-MoE,
Qwen3-MoE, GLM-4.5): the attention, norms, embeddings and LM head of llama.py, each layer's MLP chosen by
`make_mlp` (a `SparseMoeBlock`, GLM-4.5's deepseek.DeepseekMoE or a dense LlamaMLP), and checkpoint
loading that routes expert tensors (per expert or stacked 3-D) into the FusedMoE layers and fails naming
any expert projection the checkpoint lacks.

The native CPU layer stack (llama_cpu_stack.py) does not apply to these models (it needs dense MLPs);
their layers run as modules, the experts on cpu_experts.py's packed GEMMs.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from roofline.distributed.parallel_state import get_tp_size, tp_all_reduce
from roofline.model_executor.layers.linear import ReplicatedLinear
from roofline.model_executor.layers.moe import FusedMoE
from roofline.model_executor.layers.moe.checkpoint import check_experts_complete, load_expert_tensor
from roofline.model_executor.layers.moe.router import num_routed_experts, routing_from_hf_config
from roofline.model_executor.models.llama import LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    """gate (router logits) -> FusedMoE over the routed experts, plus an optional shared expert scaled
    per token by sigmoid(shared_expert_gate(x)) (Qwen2-MoE); ONE all-reduce under tensor parallelism:
    the experts and the shared expert return partial sums and are reduced together."""

    def __init__(self, config, width_field: str, shared_width: int = 0):
        """width_field: the config field holding each expert's intermediate width."""
        super().__init__()
        if shared_width % get_tp_size():
            raise ValueError(f"shared_expert_intermediate_size ({shared_width}) is not divisible by "
                             f"tensor_parallel_size ({get_tp_size()})")
        num_experts = num_routed_experts(config)
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, config.hidden_size, getattr(config, width_field),
                                routing_from_hf_config(config), reduce_results=False, width_field=width_field)
        self.shared_expert = LlamaMLP(config, shared_width, reduce_results=False) if shared_width else None
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False) if shared_width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            # the gate is replicated, so scaling each rank's partial sum scales the reduced one
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return tp_all_reduce(y)


class LlamaMoeForCausalLM(LlamaForCausalLM):
    supports_lora = False  # experts are not linear layers an adapter's tensors could land on (roofline/lora)
    keeps_quantized_weights = False  # expert stacks load dense tensors: GGUF blocks are dequantized
    # checkpoint name fragment -> ours, applied before anything else (Mixtral's "block_sparse_moe")
    renamed_modules: dict[str, str] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        check_experts_complete(self)
        return loaded

    def _load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> Optional[str]:
        for theirs, ours in self.renamed_modules.items():
            name = name.replace(theirs, ours)
        target = load_expert_tensor(self, name, tensor)
        return target if target is not None else super()._load_tensor(name, tensor, params)
