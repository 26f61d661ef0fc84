"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and DeepSeekMoE, as HF transformers
computes them (transformers/models/deepseek_v2, deepseek_v3), on the paged latent cache.

Per layer:  h = RMSNorm(x)
    q = q_proj(h)  or  q_b_proj(RMSNorm(q_a_proj(h)))                  [N, H, P + R]  (q_lora_rank)
    c, k_pe = kv_a_proj_with_mqa(h) split [L, R];  c = RMSNorm(c)        one latent per token
    q_pe, k_pe = rope(q_pe, k_pe)   on interleaved pairs (x0, x1), (x2, x3) .. as DeepSeek lays them out
    the latent row [c, k_pe] goes to the cache; attention (roofline/attention/mla): prefill up-projects
    the context through kv_b_proj, decode absorbs kv_b_proj into the query and the output
    x = x + o_proj(o);  x = x + MLP(RMSNorm(x)):  dense for layers < first_k_dense_replace, else MoE
MoE: router logits in fp32, routed experts through FusedMoE (roofline/model_executor/layers/moe) plus
the always-on shared experts, one all-reduce per layer under tensor parallelism.
  V2: softmax scores; topk_method greedy, or group_limited_greedy (the topk_group groups with the
      highest max score); weights x routed_scaling_factor (HF's V2 router does not renormalise).
  V3: sigmoid scores; e_score_correction_bias added for selection only; the topk_group groups with the
      highest sum of their top-2 biased scores; weights renormalised when norm_topk_prob, then
      x routed_scaling_factor.
Softmax scale: (P + R)^-0.5, times mscale(factor, mscale_all_dim)^2 under DeepSeek's yarn rope, whose
cos/sin carry mscale(factor, mscale) / mscale(factor, mscale_all_dim) (rotary.py).
Tensor parallelism: heads (q_b_proj / q_proj, kv_b_proj, o_proj) split; q_a / kv_a projections and the
latent cache are replicated on every rank.
DeepSeek-V3.2 (DeepseekV32ForCausalLM): V3 plus DeepSeek Sparse Attention in every layer -- a lightning
indexer (DeepseekIndexer: wq_b on the query's low-rank q_resid, wk + LayerNorm k_norm on the layer input, rope
on the first qk_rope_head_dim values in the half-split layout, weights_proj) whose keys get their own cache
(kv_spec.indexer_spec, the same block ids as the latent) and whose top-`index_topk` positions per query token
are the only ones MLA attends to (attention/sparse/dsa.py).  The indexer is replicated under tensor
parallelism, like the latent.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from roofline.attention import kv_spec
from roofline.attention.backend import AttentionBackend, AttentionMetadata
from roofline.attention.mla import MLAWeights, get_mla_backend
from roofline.attention.sparse import TopkSelection, select_topk, write_index_keys
from roofline.distributed.parallel_state import get_pp_group, get_tp_size, tp_all_reduce
from roofline.model_executor.layers.moe import FusedMoE
from roofline.model_executor.layers.moe.router import routing_from_hf_config
from roofline.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from roofline.model_executor.layers.norm import RMSNorm
from roofline.model_executor.layers.rotary import RotaryEmbedding, rope_parameters
from roofline.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from roofline.model_executor.models.llama import LlamaForCausalLM, LlamaMLP

LORA_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(config) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 when the rope is scaled."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


def rope_on_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rope: pairs (x0, x1), (x2, x3), .. each rotated by one frequency (cos/sin [N, 1, R] are
    cat(freqs, freqs) tables).  Output in halves layout [rotated evens, rotated odds], as HF's V3 does;
    q and k share the layout, so their dot products equal HF's V2 (interleaved output) as well."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The half-split (rotate_half) rope on the first cos.shape[-1] values of x [..., D] (cos/sin broadcast to
    [..., R]): the layout DSA's indexer uses, unlike MLA's interleaved pairs."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class DeepseekIndexer(nn.Module):
    """DSA's lightning indexer (HF's DeepseekV32Indexer), its parameters named as in the checkpoint
    (self_attn.indexer.{wq_b, wk, k_norm, weights_proj})."""

    def __init__(self, config):
        super().__init__()
        self.n_heads = int(config.index_n_heads)
        self.head_dim = int(config.index_head_dim)
        self.topk = int(config.index_topk)
        self.rope = int(config.qk_rope_head_dim)
        if self.head_dim < self.rope:
            raise ValueError(f"index_head_dim ({self.head_dim}) must hold the qk_rope_head_dim ({self.rope}) "
                             "roped values")
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.n_heads, bias=False)
        self.weights_proj.dense_only = True  # read as a dense fp32 matrix (HF keeps it in fp32)
        self.scale = self.head_dim ** -0.5

    def kv_cache_spec(self) -> kv_spec.KVCacheSpec:
        return kv_spec.indexer_spec(self.head_dim)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos_sin, cache: torch.Tensor,
                meta: AttentionMetadata) -> TopkSelection:
        """x [N, hidden] (the layer's normed input), q_resid [N, q_lora_rank] -> each row's kept positions;
        the rows' index keys are written to `cache` first (a row scores itself)."""
        n = x.shape[0]
        cos, sin = cos_sin  # [N, 1, R]
        q = rope_halves(self.wq_b(q_resid).view(n, self.n_heads, self.head_dim), cos, sin)
        k = rope_halves(self.k_norm(self.wk(x)), cos[:, 0], sin[:, 0])
        write_index_keys(k, cache, meta.slot_mapping)
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads ** -0.5
        return select_topk(q, w, cache, meta, self.topk, self.scale)


class DeepseekMLA(nn.Module):
    def __init__(self, config, backend: AttentionBackend):
        super().__init__()
        tp = get_tp_size()
        total_heads = config.num_attention_heads
        if total_heads % tp:
            raise ValueError(f"num_attention_heads ({total_heads}) is not divisible by tensor_parallel_size ({tp})")
        self.num_heads = total_heads // tp
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.latent = config.kv_lora_rank
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        qk = self.nope + self.rope
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk)
        else:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.latent + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.latent, total_heads * (self.nope + self.v_dim))
        self.kv_b_proj.dense_only = True  # absorbed into the query and output (MLAWeights): FP8 blocks dequantized
        self.o_proj = RowParallelLinear(total_heads * self.v_dim, hidden, bias=bias)
        self.rotary = RotaryEmbedding(self.rope, config.max_position_embeddings, rope_parameters(config))
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        self.scale = mla_softmax_scale(config)
        self.backend = get_mla_backend(backend)
        self.indexer = None
        if getattr(config, "index_topk", None) is not None:  # DeepSeek-V3.2: sparse attention
            if int(config.index_topk) <= 0:
                raise ValueError(f"index_topk must be positive, got {config.index_topk}")
            if not self.q_lora_rank:
                raise ValueError("DeepSeek sparse attention needs q_lora_rank (its indexer reads the query's "
                                 "low-rank q_resid)")
            self.indexer = DeepseekIndexer(config)

    def kv_cache_specs(self) -> list[kv_spec.KVCacheSpec]:
        """The latent, and (V3.2) the indexer's keys: one cache tensor each, in this order."""
        specs = [kv_spec.mla_spec(self.latent, self.rope)]
        return specs + [self.indexer.kv_cache_spec()] if self.indexer is not None else specs

    def forward(self, positions, x, caches: list[torch.Tensor], meta: AttentionMetadata, cos_sin) -> torch.Tensor:
        n = x.shape[0]
        cache = caches[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora_rank else None
        q = self.q_b_proj(q_resid) if self.q_lora_rank else self.q_proj(x)
        q = q.view(n, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        k_pe = k_pe.reshape(n, 1, self.rope)
        cos, sin = cos_sin
        if self.interleaved:
            q_pe, k_pe = rope_on_pairs(q_pe, cos, sin), rope_on_pairs(k_pe, cos, sin)
        else:
            q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.contiguous(), cos_sin)
        self.backend.write_latent(torch.cat((c, k_pe[:, 0]), dim=-1), cache, meta.slot_mapping)
        selection = self.indexer(x, q_resid, cos_sin, caches[1], meta) if self.indexer is not None else None
        weights = MLAWeights.from_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope, self.v_dim)
        o = self.backend.forward(q_nope, q_pe, cache, meta, weights, self.scale, selection)
        return self.o_proj(o.reshape(n, self.num_heads * self.v_dim))


class DeepseekMoE(nn.Module):
    """Router (fp32 logits), routed experts (FusedMoE) and shared experts; one all-reduce under TP.
    GLM-4.5's MoE layers are this block too (glm4_moe.py)."""

    def __init__(self, config, v3: bool):
        super().__init__()
        routing = routing_from_hf_config(config)  # unknown topk_method / scoring_func fail here, naming the field
        num_experts = config.n_routed_experts
        self.gate = DeepseekRouter(num_experts, config.hidden_size, v3)
        self.experts = FusedMoE(num_experts, config.hidden_size, config.moe_intermediate_size, routing,
                                reduce_results=False)
        shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = (LlamaMLP(config, config.moe_intermediate_size * shared, reduce_results=False)
                               if shared else None)
        self.tp_size = get_tp_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        y = self.experts(x, logits, self.gate.e_score_correction_bias)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return tp_all_reduce(y) if self.tp_size > 1 else y


class DeepseekRouter(nn.Module):
    """The router's parameters as HF names them (mlp.gate.weight, V3's mlp.gate.e_score_correction_bias)."""

    def __init__(self, num_experts: int, hidden: int, v3: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        # fp32 like HF (_keep_in_fp32_modules_strict); a parameter so a checkpoint without it fails to load
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
                                        if v3 else None)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend, v3: bool):
        super().__init__()
        self.self_attn = DeepseekMLA(config, backend)
        moe = getattr(config, "n_routed_experts", None) and layer_idx >= (getattr(config, "first_k_dense_replace", 0) or 0)
        freq = getattr(config, "moe_layer_freq", 1) or 1
        moe = moe and layer_idx % freq == 0
        self.mlp = DeepseekMoE(config, v3) if moe else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, caches, meta, cos_sin):
        """caches: this layer's cache tensors (self_attn.kv_cache_specs(), in order)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, caches, meta, cos_sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DeepseekModel(nn.Module):
    def __init__(self, config, backend: AttentionBackend, v3: bool):
        super().__init__()
        if get_pp_group().world_size > 1:
            raise ValueError("pipeline parallelism does not split DeepSeek models yet (pipeline_parallel_size must be 1)")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i, backend, v3)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # one stage holds everything (the names LlamaForCausalLM's loader and KV specs read)
        self.start_layer, self.end_layer = 0, config.num_hidden_layers
        self.is_first_stage = self.is_last_stage = True

    @property
    def stage_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                output_rows: Optional[torch.Tensor] = None):
        x = self.embed_tokens(input_ids)
        residual = None
        cos_sin = self.layers[0].self_attn.rotary.cos_sin(positions, x.dtype) if self.layers else None
        at = 0
        for layer in self.layers:  # each layer takes its caches (the latent, and V3.2's index keys)
            count = len(layer.self_attn.kv_cache_specs())
            x, residual = layer(positions, x, residual, kv_caches[at:at + count], meta, cos_sin)
            at += count
        x, _ = self.norm(x, residual) if residual is not None else (self.norm(x), None)
        return x if output_rows is None else x[output_rows]


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 (and V2-Lite / Coder-V2); load_weights, logits and the KV specs are Llama's."""

    is_v3 = False
    supports_lora = False  # MLA's projections are transformed at load; experts are not linear layers
    keeps_quantized_weights = False  # expert stacks load dense tensors: GGUF blocks are dequantized (FP8 blocks stay)
    # checkpoint name fragment -> (our parameter fragment, shard id); experts are mapped in load_weights
    stacked_params = [(".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1)]

    def __init__(self, config, backend: AttentionBackend):
        nn.Module.__init__(self)
        self.config = config
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        self.attention_backend = backend
        self.model = DeepseekModel(config, backend, self.is_v3)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_cache_specs(self) -> list[kv_spec.KVCacheSpec]:
        """Every layer's caches in layer order (V3.2: the latent, then the index keys, per layer)."""
        return [spec for layer in self.model.stage_layers for spec in layer.self_attn.kv_cache_specs()]

    def load_weights(self, weights):
        """HF names; per-expert tensors (mlp.experts.{e}.{gate,up,down}_proj.weight) go to FusedMoE's
        stacked w13 / w2 through its weight_loader, everything else as for Llama."""
        loaded: set[str] = set()

        def rest():
            for name, tensor in weights:
                if not self.holds_tensor(name):
                    continue  # e.g. the MTP layers past num_hidden_layers (deepseek_mtp.py loads those)
                target = load_expert_tensor(self, name, tensor)
                if target is None:
                    yield name, tensor
                else:
                    loaded.add(target)

        loaded |= super().load_weights(rest())
        check_experts_loaded(self)
        return loaded


_EXPERT_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def load_expert_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> Optional[str]:
    """A per-expert checkpoint tensor (...mlp.experts.{e}.{gate,up,down}_proj.weight) into its FusedMoE's
    stacked w13 / w2 (this rank's slots); returns the stack's name, None for any other tensor."""
    parts = name.split(".")
    if "experts" not in parts or not parts[parts.index("experts") + 1].isdigit():
        return None
    i = parts.index("experts")
    expert, proj = int(parts[i + 1]), parts[i + 2]
    moe = model.get_submodule(".".join(parts[:i + 1]))
    target = "w13_weight" if proj in ("gate_proj", "up_proj") else "w2_weight"
    param = getattr(moe, target)
    moe.weight_loader(param, tensor, _EXPERT_SHARDS[proj], expert)  # (it converts a dense tensor's dtype)
    return ".".join(parts[:i + 1] + [target])


def check_experts_loaded(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and module.missing_experts():
            expert, shard = module.missing_experts()[0]
            proj = {v: k for k, v in _EXPERT_SHARDS.items()}[shard]
            raise ValueError(f"checkpoint is missing expert tensors, e.g. {name}.{expert}.{proj}.weight")


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    is_v3 = True


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: V3 with DeepSeek Sparse Attention (the indexer in every layer's DeepseekMLA)."""

    def __init__(self, config, backend: AttentionBackend):
        if getattr(config, "index_topk", None) is None:
            raise ValueError("DeepseekV32ForCausalLM needs index_topk (and index_n_heads, index_head_dim) in its config")
        super().__init__(config, backend)
