"""Qwen3-Next (Qwen3NextForCausalLM), as HF transformers computes it:

    x = embed(ids)
    per layer (layer_types):  x = x + mixer(RMSNorm(x));  x = x + ffn(RMSNorm(x))      RMSNorms scale by (1 + w)
      "linear_attention": Gated DeltaNet.  in_proj_qkvz / in_proj_ba (grouped per key head) give q, k, v, z, b, a;
          [q | k | v] -> causal depthwise conv (kernel linear_conv_kernel_dim) -> silu;
          o = gated delta rule (layers/gated_delta_rule.py; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias));
          o = RMSNorm_w(o) * silu(z) per value head (the gated norm: a plain w);  out_proj(o)
      "full_attention": q_proj gives per head [query | gate]; per-head (1 + w) q/k norms, partial rotary
          (partial_rotary_factor), paged causal attention, o * sigmoid(gate), o_proj
    ffn: a sparse MoE block (softmax top-k over num_experts, norm_topk_prob, plus a shared expert scaled by
         sigmoid(shared_expert_gate(x))) where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers,
         else a dense SwiGLU MLP of width intermediate_size.
    logits = RMSNorm(x) W_lm^T

KV cache: a full-attention layer declares an attention spec (paged K/V per token); a linear-attention layer a
recurrent spec (attention/kv_spec.recurrent_spec): per running request one state slot holding the conv state
(the last kernel - 1 inputs of the q/k/v channels) and the fp32 matrix state [H_v, d_k, d_v].  A step reads each
request's slot from AttentionMetadata.state_slots_cpu; a request whose context before the step is empty starts
from zeros.  Decode rows run the recurrent form (all decodes of a step at once), prefill chunks the chunked form
from the state the previous chunk left -- HF's own split (chunked for a prompt, recurrent per generated token).

Prefix caching is off for this model (EngineCore.check_recurrent_state): a state at a block boundary is not kept,
so a repeated prompt is computed again.  Preemption recomputes (the slot goes back with the blocks; swap mode is
refused at start-up), forked requests (n > 1) compute their prompt themselves.  Tensor parallelism splits the
key-head groups (and their value heads) of the linear layers and the heads of the attention layers; pipeline
parallelism, speculative decoding, KV transfer, data-parallel attention and LoRA are refused at start-up.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from roofline.attention import kv_spec
from roofline.attention.backend import PLAIN, AttentionBackend, AttentionMetadata
from roofline.distributed.parallel_state import get_tp_rank, get_tp_size
from roofline.model_executor.layers.gated_delta_rule import (
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from roofline.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from roofline.model_executor.layers.rotary import RotaryEmbedding, rope_parameters
from roofline.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from roofline.model_executor.models.gemma import GemmaRMSNorm
from roofline.model_executor.models.llama import LlamaMLP
from roofline.model_executor.models.llama_moe import LlamaMoeForCausalLM, SparseMoeBlock
from roofline.model_executor.models.qwen_moe import is_sparse_layer

LAYER_TYPES = ("linear_attention", "full_attention")


def _split(total: int, what: str) -> int:
    tp = get_tp_size()
    if total % tp:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({tp})")
    return total // tp


class _RankSlice(nn.Module):
    """A holder whose parameter is this rank's slice of a checkpoint tensor cut into parts along dim 0
    (the conv weight: [q | k | v] channels, each part split over the ranks)."""

    def __init__(self, parts: list[int], *rest: int):
        super().__init__()
        self.parts = parts  # this rank's size of each part
        self.weight = nn.Parameter(torch.empty(sum(parts), *rest), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rank, off, src = get_tp_rank(), 0, 0
        for n in self.parts:
            param.data.narrow(0, off, n).copy_(loaded.narrow(0, src + rank * n, n))
            off, src = off + n, src + n * get_tp_size()


class GatedRMSNorm(nn.Module):
    """RMSNorm_w(x) * silu(z) over the last dim (HF's Qwen3NextRMSNormGated: a plain w, norm before the gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        h = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        nk_total, nv_total = config.linear_num_key_heads, config.linear_num_value_heads
        if nv_total % nk_total:
            raise ValueError(f"linear_num_value_heads ({nv_total}) must be a multiple of linear_num_key_heads "
                             f"({nk_total})")
        self.nk = _split(nk_total, "linear_num_key_heads")
        self.nv = self.nk * (nv_total // nk_total)
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.ratio = nv_total // nk_total
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for Qwen3-Next (only silu)")
        hidden = config.hidden_size
        self.in_proj_qkvz = ColumnParallelLinear(hidden, nk_total * (2 * self.dk + 2 * self.ratio * self.dv))
        self.in_proj_ba = ColumnParallelLinear(hidden, nk_total * 2 * self.ratio)
        self.conv1d = _RankSlice([self.key_dim, self.key_dim, self.value_dim], 1, self.kernel)
        self.dt_bias = nn.Parameter(torch.ones(self.nv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.nv), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(nv_total * self.dv, hidden)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """dt_bias and A_log: this rank's value heads."""
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, get_tp_rank() * n, n))

    def kv_cache_spec(self) -> kv_spec.KVCacheSpec:
        return kv_spec.recurrent_spec(self.conv_dim, self.kernel, self.nv, self.dk, self.dv)

    def forward(self, positions, x: torch.Tensor, state: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [N, d]; state [slots, conv_dim (K-1) + H_v d_k d_v] fp32, this layer's state pool (updated in place)."""
        n = x.shape[0]
        qkvz = self.in_proj_qkvz(x).view(n, self.nk, 2 * self.dk + 2 * self.ratio * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, self.ratio * self.dv, self.ratio * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(n, self.nk, 2 * self.ratio).split([self.ratio, self.ratio], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)  # [N, conv_dim]
        z = z.reshape(n, self.nv, self.dv)
        beta = b.reshape(n, self.nv).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(n, self.nv).float() + self.dt_bias)
        slots = meta.state_slots_cpu
        if slots is None:
            raise RuntimeError("a linear-attention layer needs the step's state slots (AttentionMetadata.state_slots_cpu)")
        conv_n = self.conv_dim * (self.kernel - 1)
        conv_states = state[:, :conv_n].view(-1, self.conv_dim, self.kernel - 1)
        ssm_states = state[:, conv_n:].view(-1, self.nv, self.dk, self.dv)
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        out = torch.empty(n, self.nv, self.dv, dtype=x.dtype, device=x.device)
        # decodes first (one row each): all at once, the recurrent form
        nd = meta.num_decodes
        if nd:
            idx = torch.tensor(slots[:nd], device=x.device)
            fresh = torch.tensor([seq_lens[r] == 1 for r in range(nd)], device=x.device)
            keep = (~fresh).to(torch.float32)
            conv_out, conv_new = causal_conv1d(mixed[:nd, :, None], conv_states[idx] * keep[:, None, None],
                                               self.conv1d.weight[:, 0])
            conv_states[idx] = conv_new.float()
            o, s_new = recurrent_gated_delta_rule(*self._qkv(conv_out[:, :, 0][:, None]), g[:nd, None],
                                                  beta[:nd, None], ssm_states[idx] * keep[:, None, None, None])
            ssm_states[idx] = s_new
            out[:nd] = o[:, 0]
        for r in range(nd, meta.num_reqs):  # prefill chunks: each from the state its previous chunk left
            q0, q1, slot = qsl[r], qsl[r + 1], slots[r]
            c = q1 - q0
            start = seq_lens[r] - c == 0
            conv_prev = conv_states[slot:slot + 1]
            conv_out, conv_new = causal_conv1d(mixed[q0:q1].t()[None], torch.zeros_like(conv_prev) if start
                                               else conv_prev, self.conv1d.weight[:, 0])
            conv_states[slot] = conv_new[0].float()
            ssm_prev = ssm_states[slot:slot + 1]
            fn = recurrent_gated_delta_rule if c == 1 else chunk_gated_delta_rule
            o, s_new = fn(*self._qkv(conv_out[0].t()[None]), g[None, q0:q1], beta[None, q0:q1],
                          torch.zeros_like(ssm_prev) if start else ssm_prev)
            ssm_states[slot] = s_new[0]
            out[q0:q1] = o[0]
        o = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(n, self.value_dim)
        return self.out_proj(o)

    def _qkv(self, conv_out: torch.Tensor):
        """[B, T, conv_dim] -> q, k [B, T, H_k, d_k], v [B, T, H_v, d_v]."""
        b, t = conv_out.shape[:2]
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(b, t, self.nk, self.dk), k.reshape(b, t, self.nk, self.dk),
                v.reshape(b, t, self.nv, self.dv))


class Qwen3NextAttention(nn.Module):
    """Gated full attention: q_proj gives per head [query | gate] (loaded as 2 H pseudo-heads of head_dim, so a
    tensor-parallel rank holds whole heads with their gates)."""

    def __init__(self, config, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, 2 * heads, kv_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias=bias)
        self.scale = self.head_dim ** -0.5
        rope = rope_parameters(config)
        partial = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope,
                                      rotary_dim=int(self.head_dim * partial))
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def kv_cache_spec(self) -> kv_spec.KVCacheSpec:
        return kv_spec.attention_spec(self.num_kv_heads, self.head_dim)

    def forward(self, positions, x, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(n, self.num_heads, 2 * d).split([d, d], dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(n, self.num_kv_heads, d))
        q, k = self.rotary(positions, q, k)
        v = v.reshape(n, self.num_kv_heads, d)
        self.backend.write_kv(k, v, kv_cache, meta.slot_mapping)
        o = self.backend.forward(q, kv_cache, meta, self.scale, PLAIN).reshape(n, self.q_size)
        return self.o_proj(o * torch.sigmoid(gate.reshape(n, self.q_size)))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = Qwen3NextAttention(config, layer_idx, backend)
        if is_sparse_layer(config, layer_idx):
            self.mlp = SparseMoeBlock(config, "moe_intermediate_size",
                                      getattr(config, "shared_expert_intermediate_size", 0) or 0)
        else:
            self.mlp = LlamaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.layer_type == "linear_attention" else self.self_attn

    def forward(self, positions, x, residual: Optional[torch.Tensor], cache: torch.Tensor, meta: AttentionMetadata):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.mixer(positions, h, cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, config, backend: AttentionBackend):
        super().__init__()
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != config.num_hidden_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types entries {unknown} are not supported for Qwen3-Next; supported: "
                             f"{list(LAYER_TYPES)}")
        self.start_layer, self.end_layer = 0, config.num_hidden_layers
        self.is_first_stage = self.is_last_stage = True
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, i, backend) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cpu_stack = None  # the Llama layer stack does not apply

    @property
    def stage_layers(self) -> list[Qwen3NextDecoderLayer]:
        return list(self.layers)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                output_rows: Optional[torch.Tensor] = None):
        x, residual = self.embed_tokens(input_ids), None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, cache, meta)
        x, _ = self.norm(x, residual)
        return x if output_rows is None else x[output_rows]


class Qwen3NextForCausalLM(LlamaMoeForCausalLM):
    has_recurrent_state = True  # linear-attention layers (EngineCore.check_recurrent_state)
    supports_kv_groups = False
    keeps_quantized_weights = False
    supports_lora = False  # stacked_params: LlamaForCausalLM's (q/k/v and gate/up fused)

    def __init__(self, config, backend: AttentionBackend):
        nn.Module.__init__(self)
        from roofline.distributed import pipeline

        if not (pipeline.is_first_stage() and pipeline.is_last_stage()):
            raise ValueError("Qwen3NextForCausalLM does not support pipeline parallelism")
        self.config = config
        self.attention_backend = backend
        self.model = Qwen3NextModel(config, backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta, output_rows: Optional[torch.Tensor] = None,
                intermediate=None):
        return self.model(input_ids, positions, kv_caches, meta, output_rows)

    def kv_cache_specs(self) -> list[kv_spec.KVCacheSpec]:
        """Per layer: a recurrent state (linear attention) or paged K/V (full attention)."""
        return [layer.mixer.kv_cache_spec() for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((name, t) for name, t in weights if ".mtp." not in name and not name.startswith("mtp."))
