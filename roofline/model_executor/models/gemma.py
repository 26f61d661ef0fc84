"""Gemma 2 and Gemma 3 (text), as HF transformers computes them:

    x = embed(ids) * sqrt(hidden)                      (the factor rounded to the model's dtype, as HF does)
    per layer:  x = x + RMSNorm_post_attn(attention(RMSNorm_in(x)))
                x = x + RMSNorm_post_ff(mlp(RMSNorm_pre_ff(x)))      mlp: gelu_tanh(gate) * up  (GeGLU)
    logits = softcap(RMSNorm(x) W_embed^T)             softcap(s) = c tanh(s / c) where final_logit_softcapping
Every norm scales by (1 + w): the checkpoint's w is loaded as 1 + w, so the one RMSNorm (and its fused kernel)
runs them.  Attention: scores scaled by query_pre_attn_scalar^-1/2; `layer_types` says which layers are
"sliding_attention" (a query sees its last `sliding_window` keys) and which "full_attention"; Gemma 2
soft-caps the scores (attn_logit_softcapping); Gemma 3 norms q and k per head and ropes sliding and full
layers with their own `rope_parameters` (a local base, a global base with its own scaling).  The window,
the cap and the sinks go to the attention backend as AttentionOptions.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from roofline.attention.backend import AttentionBackend, AttentionMetadata, AttentionOptions
from roofline.model_executor.layers.activation import GeluTanhAndMul
from roofline.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from roofline.model_executor.layers.norm import RMSNorm
from roofline.model_executor.layers.rotary import RotaryEmbedding
from roofline.model_executor.models.llama import LAYER_TYPES, LlamaAttention, LlamaForCausalLM


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight w means a scale of (1 + w): loaded as 1 + w (in fp32, as HF adds it)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_((1.0 + loaded.float()).to(param.dtype))


class GemmaMLP(nn.Module):
    """gelu_tanh(x W_gate) * (x W_up) W_down on the merged [gate | up] projection."""

    activation = "gelu_pytorch_tanh"

    def __init__(self, config):
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported for Gemma (only gelu_pytorch_tanh)")
        width = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [width] * 2, bias=False)
        self.down_proj = RowParallelLinear(width, config.hidden_size, bias=False)
        self.act = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def layer_rope_parameters(config, layer_type: str) -> dict:
    """rope_theta and scaling of one layer kind: Gemma 3 keeps a dict per layer type, Gemma 2 one for all."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type in params or any(t in params for t in LAYER_TYPES):
        params = dict(params.get(layer_type) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class GemmaAttention(LlamaAttention):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend, qk_norm: bool):
        super().__init__(config, layer_idx, backend, qk_norm=False, bias=bool(getattr(config, "attention_bias", False)),
                         o_bias=bool(getattr(config, "attention_bias", False)))
        self.layer_type = config.layer_types[layer_idx]  # checked by LlamaAttention (layer_sliding_window)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.attn_options = AttentionOptions(sliding_window=self.attn_options.sliding_window,
                                             logit_softcap=getattr(config, "attn_logit_softcapping", None))
        self.rope_parameters = layer_rope_parameters(config, self.layer_type)
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, self.rope_parameters)
        self.own_rope_table = False  # True where this layer's rope differs from the step's shared table
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions, x, kv_cache: torch.Tensor, meta: AttentionMetadata, cos_sin=None,
                keep: Optional[torch.Tensor] = None):
        return super().forward(positions, x, kv_cache, meta, None if self.own_rope_table else cos_sin, keep)


class GemmaDecoderLayer(nn.Module):
    """Norms before and after each block.  Returns (the block output h, the stream before it) so that
    LlamaModel's convention holds: the next layer's input, and the final norm's, is h + stream."""

    qk_norm = False

    def __init__(self, config, layer_idx: int, backend: AttentionBackend, *_):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_idx, backend, self.qk_norm)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, positions, x, residual: Optional[torch.Tensor], kv_cache, meta, cos_sin=None,
                keep: Optional[torch.Tensor] = None):
        stream = x if residual is None else x + residual
        h = self.self_attn(positions, self.input_layernorm(stream), kv_cache, meta, cos_sin, keep)
        if keep is not None:
            stream = stream[keep]
        stream = stream + self.post_attention_layernorm(h)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(stream))), stream


class Gemma3DecoderLayer(GemmaDecoderLayer):
    qk_norm = True


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GemmaDecoderLayer

    def __init__(self, config, backend: AttentionBackend):
        if not getattr(config, "layer_types", None):
            raise ValueError("a Gemma config needs layer_types (sliding_attention / full_attention per layer)")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (a causal language model only)")
        super().__init__(config, backend)
        inner = self.model
        if inner.is_last_stage:
            inner.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # HF multiplies by sqrt(hidden) rounded to the activations' dtype (the parameters' dtype here)
        inner.embedding_multiplier = float(torch.tensor(config.hidden_size ** 0.5, dtype=torch.get_default_dtype(),
                                                        device="cpu"))  # (a value, also when built on the meta device)
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)
        layers = inner.stage_layers
        if layers:
            shared = layers[0].self_attn.rope_parameters
            for layer in layers:
                layer.self_attn.own_rope_table = layer.self_attn.rope_parameters != shared

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_logit_softcap:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def greedy_tokens(self, hidden: torch.Tensor, rows: list[int]) -> Optional[torch.Tensor]:
        if self.final_logit_softcap:
            return None  # the cap can tie logits the raw ones order: the argmax of the capped logits, as HF
        return super().greedy_tokens(hidden, rows)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    decoder_layer_cls = Gemma3DecoderLayer
