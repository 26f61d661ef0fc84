"""DeepSeek-V3's multi-token prediction (MTP) module, as speculative decoding's proposer model
(spec_decode/mtp.py).

A checkpoint with `num_nextn_predict_layers` >= 1 stores the module as layer `num_hidden_layers`
(model.layers.{N}.*): enorm and hnorm (RMSNorm), eh_proj (2H -> H, no bias), one full decoder layer
(MLA attention and, past first_k_dense_replace, DeepSeekMoE) and shared_head.norm; its embedding and
output head are the main model's (shared_head.head / embed_tokens copies in the checkpoint are skipped).

At position p it reads the main model's final hidden state h_p and the *next* token t_{p+1}:

    x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])      (the embedding is zero at position 0)
    y = decoder_layer(x)  (its residual added back)       logits = head(shared_head.norm(y))  -> t_{p+2}

Its attention keeps a KV cache of its own (one MLA latent layer: kv_cache_specs) in the target's
block geometry.  Proposing more than one token re-applies the module to its own output y and the token
it just proposed, as vLLM and SGLang do with V3's single MTP layer.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from roofline.attention import kv_spec
from roofline.attention.backend import AttentionBackend, AttentionMetadata
from roofline.model_executor.layers.linear import ReplicatedLinear
from roofline.model_executor.layers.norm import RMSNorm
from roofline.model_executor.models.deepseek import (
    DeepseekDecoderLayer,
    DeepseekV2ForCausalLM,
    check_experts_loaded,
    load_expert_tensor,
)
from roofline.model_executor.models.llama import load_named_tensor


class SharedHead(nn.Module):
    """The module's own final norm (the head itself is the main model's LM head)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


class DeepseekMTP(DeepseekDecoderLayer):
    """The MTP module: a DeepSeek decoder layer (self_attn, mlp, input/post_attention_layernorm, named as
    in the checkpoint) plus enorm, hnorm, eh_proj and shared_head.norm.  `target` lends its embedding and
    LM head (not registered here: loading, dummy weights and CPU packing leave them to the target)."""

    def __init__(self, config, backend: AttentionBackend, target: DeepseekV2ForCausalLM):
        num_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        if num_mtp < 1:
            raise ValueError("speculative_config.method 'mtp' needs a checkpoint with MTP layers "
                             "(num_nextn_predict_layers >= 1); this model has none")
        self.layer_index = int(config.num_hidden_layers)  # the first MTP layer's place in the checkpoint
        super().__init__(config, self.layer_index, backend, v3=True)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(hidden, eps)
        self._target = (target,)  # a tuple: not a submodule

    # ---- the proposer's view -----------------------------------------------------------------
    def kv_cache_specs(self) -> list[kv_spec.KVCacheSpec]:
        return self.self_attn.kv_cache_specs()  # the latent (and a V3.2 checkpoint's index keys)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [N]: the token after each row's position; previous_hidden [N, H]: the main model's
        final hidden state there (or this module's own output, proposing further) -> y [N, H]."""
        target = self._target[0]
        emb = target.model.embed_tokens(input_ids)
        emb = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(emb), emb)
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(previous_hidden)), dim=-1))
        cos_sin = self.self_attn.rotary.cos_sin(positions, x.dtype)
        y, residual = super().forward(positions, x, None, kv_caches, meta, cos_sin)
        return y + residual

    def compute_logits(self, y: torch.Tensor) -> torch.Tensor:
        return self._target[0].lm_head.compute_logits(self.shared_head.norm(y))

    # ---- loading -----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The model.layers.{N}.* tensors of a DeepSeek-V3 checkpoint (everything else is skipped)."""
        prefix = f"model.layers.{self.layer_index}."
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if not name.startswith(prefix):
                continue
            name = name[len(prefix):]
            if name.startswith(("embed_tokens.", "shared_head.head.")) or "rotary_emb.inv_freq" in name:
                continue  # the main model's
            target = load_expert_tensor(self, name, tensor)
            if target is None:
                target = load_named_tensor(self, name, tensor, params, DeepseekV2ForCausalLM.stacked_params)
            if target is not None:
                loaded.add(target)
        check_experts_loaded(self)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing MTP tensors ({prefix}*), e.g. {prefix}{missing[0]}")
        return loaded
