"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM), as HF transformers computes it (transformers/models/glm4_moe).

The layer is Llama's (llama.py) with:
  attention   q/k/v biases when `attention_bias` (o_proj never has one); per-head q/k RMSNorm before the
              rope when `use_qk_norm`; rope on the first head_dim x `partial_rotary_factor` values of each
              head only (transformers 5 keeps the factor in rope_parameters), in the half-split
              (rotate_half) layout, the rest passed through -- LlamaAttention's partial rotary
  feed-forward a dense SwiGLU MLP (intermediate_size) for the first `first_k_dense_replace` layers,
              DeepSeek-V3's MoE block for the others: deepseek.DeepseekMoE, its router (fp32 logits,
              sigmoid scores, e_score_correction_bias for the choice only, the `topk_group` of `n_group`
              groups by their top-2 sums, `norm_topk_prob`, `routed_scaling_factor`), FusedMoE experts of
              width moe_intermediate_size and `n_shared_experts` shared experts; one all-reduce under
              tensor parallelism, whole experts per rank under expert parallelism (and EPLB)
HF's GLM router reads no topk_method / scoring_func: a config naming another than noaux_tc / sigmoid
fails at start-up (router.routing_from_hf_config).

Multi-token prediction: a GLM-4.5 checkpoint stores its `num_nextn_predict_layers` MTP layers as
model.layers.{num_hidden_layers + i}.* (eh_proj, enorm, hnorm, shared_head, a full MoE layer).  They are
not served: loading skips them (holds_tensor: past the decoder's layers) and speculative method 'mtp'
is refused at start-up for this architecture (engine_core: it proposes with DeepSeek's MLA layer only).

The fp32 CPU layer stack (llama_cpu_stack.py) steps aside for every model with an MoE layer (it needs
dense MLPs); a config whose layers are all dense (first_k_dense_replace >= num_hidden_layers) is a plain
Llama layer stack with q/k/v biases, q/k norms and partial rope, which the stack runs.
"""

from __future__ import annotations

from torch import nn

from roofline.attention.backend import AttentionBackend
from roofline.model_executor.models.deepseek import DeepseekMoE
from roofline.model_executor.models.llama import LlamaMLP
from roofline.model_executor.models.llama_moe import LlamaMoeForCausalLM


class Glm4MoeForCausalLM(LlamaMoeForCausalLM):
    o_bias_follows_qkv = False  # q/k/v biases with attention_bias, o_proj none

    def __init__(self, config, backend: AttentionBackend):
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        super().__init__(config, backend)

    @property
    def qk_norm(self) -> bool:  # read by LlamaForCausalLM.__init__ (self.config is set by then)
        return bool(getattr(self.config, "use_qk_norm", False))

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if layer_idx < int(getattr(config, "first_k_dense_replace", 0) or 0):
            return LlamaMLP(config)
        return DeepseekMoE(config, v3=True)
