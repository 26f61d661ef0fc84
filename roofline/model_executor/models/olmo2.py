"""OLMo 2 (Olmo2ForCausalLM), as HF transformers computes it: Llama's attention and MLP with

    q = RMSNorm_q(q_proj(x)), k = RMSNorm_k(k_proj(x))   over the whole projection (every head at once)
    x = x + RMSNorm(attention(x));  x = x + RMSNorm(MLP(x))   post-norms: no norm before either block

Under tensor parallelism each rank holds its heads' slice of q / k and of the norms' weights; the mean of
squares over the whole projection is one all-reduce of the ranks' sums (a KV head replicated over several
ranks, tp > num_key_value_heads, counted once).  The fp32 layer stack runs plain Llama layers and steps aside.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from roofline.attention.backend import AttentionBackend, AttentionMetadata
from roofline.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from roofline.model_executor.layers.norm import RMSNorm
from roofline.model_executor.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a projection whose width is split across tensor-parallel ranks in `shards` equal parts
    per rank (the weight [total] is loaded as this rank's slice); replicas: how many ranks hold each part."""

    def __init__(self, local: int, total: int, eps: float, replicas: int = 1, part: Optional[int] = None):
        super().__init__()
        self.local, self.total, self.eps, self.replicas = local, total, eps, replicas
        self.part = get_tp_rank() if part is None else part  # which slice of the weight this rank holds
        self.weight = nn.Parameter(torch.ones(local), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(0, self.part * self.local, self.local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        sq = x32.pow(2).sum(-1, keepdim=True)
        if self.local != self.total:
            sq = tp_all_reduce(sq) / self.replicas
        return (self.weight * (x32 * torch.rsqrt(sq / self.total + self.eps))).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend):
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, backend, qk_norm=False, bias=bias, o_bias=bias)
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        eps = config.rms_norm_eps
        replicas = self.qkv_proj.kv_replicas
        self.q_norm = ShardedRMSNorm(self.q_size, total_heads * self.head_dim, eps)
        self.k_norm = ShardedRMSNorm(self.kv_size, total_kv * self.head_dim, eps, replicas,
                                     part=get_tp_rank() // replicas)
        self.full_qk_norm = True

    def forward(self, positions, x, kv_cache: torch.Tensor, meta: AttentionMetadata, cos_sin=None,
                keep: Optional[torch.Tensor] = None):
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k, cos_sin)
        self.backend.write_kv(k, v, kv_cache, meta.slot_mapping)
        o = self.backend.forward(q, kv_cache, meta, self.scale).reshape(n, self.q_size)
        return self.o_proj(o if keep is None else o[keep])


class Olmo2DecoderLayer(nn.Module):
    """Post-norm layer.  Returns (the block output h, the stream before it) so that LlamaModel's
    convention holds: the next layer's input, and the final norm's, is h + stream."""

    def __init__(self, config, layer_idx: int, backend: AttentionBackend, *_):
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_idx, backend)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual: Optional[torch.Tensor], kv_cache, meta, cos_sin=None,
                keep: Optional[torch.Tensor] = None):
        stream = x if residual is None else x + residual
        h = self.self_attn(positions, stream, kv_cache, meta, cos_sin, keep)
        if keep is not None:
            stream = stream[keep]
        stream = stream + self.post_attention_layernorm(h)
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Olmo2DecoderLayer

    def __init__(self, config, backend: AttentionBackend):
        tp = get_tp_size()
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if tp > kv and tp % kv:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide or be a multiple of num_key_value_heads ({kv})")
        super().__init__(config, backend)
