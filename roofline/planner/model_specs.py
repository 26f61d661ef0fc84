"""Model shapes for the capacity planner: parameter counts, KV bytes per token, FLOPs per token.

A `ModelSpec` is built from a Hugging Face config (a `config.json` in a local directory, a
`transformers.PretrainedConfig`, or a plain dict in the same format). Built-in presets carry the
published configs of a few well-known models, so planning needs no download.

Conventions (stated once, used everywhere):

* Parameter counts are exact for the architecture: projections, gated MLP (3 matrices), norms,
  biases where the config has them, embeddings, and the LM head (counted once when tied).
* A decode step *reads* every weight except the input-embedding table (only `batch` rows of it are
  gathered). With tied embeddings that table is the LM head, which is read in full, so it counts once.
* MoE: all experts sit in memory; a decode step reads the experts its tokens touch. With uniform
  routing of `k` of `E` experts per token, a batch of `n` tokens touches `E * (1 - (1 - k/E)**n)`
  experts per MoE layer in expectation. FLOPs use the `k` routed experts (+ shared ones) per token.
* KV cache per token per layer: GQA/MHA stores K and V, `2 * num_kv_heads * head_dim` values;
  MLA (DeepSeek-V2/V3) stores the compressed latent plus the decoupled RoPE key,
  `kv_lora_rank + qk_rope_head_dim` values (576 for DeepSeek-V3), shared by all heads.
* Tensor parallelism of degree `tp` shards weights `1/tp` and GQA KV heads `ceil(kv_heads/tp)` per
  GPU (a KV head is replicated when there are fewer KV heads than GPUs). An MLA latent cannot be
  split by heads, so with plain TP every GPU holds the whole latent cache (the pitfall described in
  the DeepSeek deployment notes); the planner reports it that way.
* Linear attention (Qwen3-Next's Gated DeltaNet layers, `num_linear_layers` of them): no KV per token; each
  request keeps a fixed fp32 state per such layer (conv state conv_dim x (kernel - 1) plus the matrix state
  H_v x d_k x d_v), split over TP ranks by heads.  A decode step reads and writes it once per sequence
  (`recurrent_state_bytes_per_step`), counted with the KV bytes a decode token reads; KV per token counts the
  full-attention layers only.  Qwen3-Next's q_proj also gives a per-head output gate (`attn_output_gate`).
* Attention FLOPs per new token at context `S`: `2 * S * n_heads * (d_qk + d_v)` per layer
  (scores and weighted sum). For MLA decode the absorbed form is used (`d_qk = kv_lora_rank +
  qk_rope_head_dim`, `d_v = kv_lora_rank`); for MLA prefill the expanded per-head dims.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from roofline.planner.hardware import normalize_dtype


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense layers of an MoE model use it too)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    mlp_matrices: int = 3  # gated MLP (SwiGLU/GeGLU): gate, up, down
    # Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank > 0 switches it on
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek Sparse Attention (V3.2): index_topk > 0 switches it on
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    # Mixture of experts; num_experts > 0 switches it on
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # total width of always-on shared expert(s) per MoE layer
    shared_expert_gate: bool = False  # Qwen2-MoE: a [1 x hidden] gate scales the shared expert per token
    num_moe_layers: int = 0
    # sliding-window attention (Mistral, Gemma 2/3, gpt-oss, Phi-3-mini): num_sliding_layers of the layers see
    # only the last sliding_window positions; 0: none
    sliding_window: int = 0
    num_sliding_layers: int = 0
    # linear attention (Qwen3-Next): num_linear_layers of the layers keep a recurrent state instead of KV
    num_linear_layers: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    attn_output_gate: bool = False  # q_proj also gives a sigmoid gate per head (Qwen3-Next's full attention)
    native_dtype: str = "bf16"  # dtype of the released checkpoint
    weight_block_elems: int = 0  # FP8 block checkpoints: weights per fp32 scale (128 x 128); 0: none

    # ---- structure -------------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_dsa(self) -> bool:
        return self.is_mla and self.index_topk > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.num_moe_layers > 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache (all but the linear-attention ones)."""
        return self.num_layers - self.num_linear_layers

    @property
    def linear_conv_dim(self) -> int:
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def linear_attention_params_per_layer(self) -> int:
        """Gated DeltaNet: in_proj_qkvz, in_proj_ba, the depthwise conv, out_proj, A_log, dt_bias, the gated norm."""
        h, vdim = self.hidden_size, self.linear_num_value_heads * self.linear_value_head_dim
        kdim = self.linear_num_key_heads * self.linear_key_head_dim
        return (h * (2 * kdim + 2 * vdim) + h * 2 * self.linear_num_value_heads
                + self.linear_conv_dim * self.linear_conv_kernel + vdim * h
                + 2 * self.linear_num_value_heads + self.linear_value_head_dim)

    def recurrent_state_bytes(self, tp: int = 1) -> float:
        """One request's recurrent state over the linear layers on one GPU (fp32), whatever its length."""
        if not self.num_linear_layers:
            return 0.0
        per_layer = (self.linear_conv_dim * (self.linear_conv_kernel - 1)
                     + self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim)
        return self.num_linear_layers * per_layer / tp * 4

    def recurrent_state_bytes_per_step(self, tp: int = 1) -> float:
        """Bytes a decode step moves per sequence for its recurrent state: read once and written once."""
        return 2 * self.recurrent_state_bytes(tp)

    # ---- parameter counts ------------------------------------------------------------------
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.is_mla:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_heads * qk_head
            else:
                q = h * self.num_heads * qk_head
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank  # + latent norm
            kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            o = self.num_heads * self.v_head_dim * h
            indexer = 0
            if self.is_dsa:  # wq_b, wk (+ LayerNorm), weights_proj
                indexer = (self.q_lora_rank * self.index_n_heads * self.index_head_dim
                           + h * self.index_head_dim + 2 * self.index_head_dim + h * self.index_n_heads)
            return q + kv_a + kv_b + o + indexer
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        n = h * q_out * (2 if self.attn_output_gate else 1) + 2 * h * kv_out + q_out * h
        if self.attention_bias:
            n += q_out + 2 * kv_out
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def dense_mlp_params(self) -> int:
        return self.mlp_matrices * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        return self.mlp_matrices * self.hidden_size * self.moe_intermediate_size

    def moe_always_on_params(self) -> int:
        """Shared experts (and their gate) + router of one MoE layer (read and computed for every token)."""
        return (self.mlp_matrices * self.hidden_size * self.shared_intermediate_size
                + self.hidden_size * (self.num_experts + self.shared_expert_gate))

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        n = self.num_layers * 2 * self.hidden_size + self.hidden_size  # two RMSNorms a layer, the final norm
        n += self.num_attention_layers * self.attention_params_per_layer()
        n += self.num_linear_layers * self.linear_attention_params_per_layer()
        n += self.num_dense_layers * self.dense_mlp_params()
        if self.is_moe:
            n += self.num_moe_layers * (self.num_experts * self.expert_params() + self.moe_always_on_params())
        return n + self.embedding_params + self.lm_head_params

    def active_params(self) -> int:
        """Parameters a single token multiplies by (what `2 * params` FLOPs counts): all but the
        unused routed experts and the input-embedding gather; the LM head always included."""
        n = self.total_params() - self.embedding_params
        if self.tie_word_embeddings:
            n += self.embedding_params  # the tied table is the LM head's matrix
        if self.is_moe:
            n -= self.num_moe_layers * (self.num_experts - self.num_experts_per_tok) * self.expert_params()
        return n

    def expected_experts_touched(self, num_tokens: float) -> float:
        """Expected distinct routed experts per MoE layer hit by `num_tokens` tokens (uniform routing)."""
        if not self.is_moe or num_tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** num_tokens)

    def weight_params_read(self, num_tokens: float) -> float:
        """Parameters read from memory by one forward pass over `num_tokens` tokens."""
        n = float(self.total_params())
        if not self.tie_word_embeddings:
            n -= self.embedding_params  # only num_tokens rows are gathered: negligible
        if self.is_moe:
            unused = self.num_experts - self.expected_experts_touched(num_tokens)
            n -= self.num_moe_layers * unused * self.expert_params()
        return n

    # ---- KV cache --------------------------------------------------------------------------
    def kv_values_per_token_per_layer(self, tp: int = 1) -> int:
        if self.is_mla:  # replicated on every TP rank (DSA: and the indexer's key)
            return self.kv_lora_rank + self.qk_rope_head_dim + (self.index_head_dim if self.is_dsa else 0)
        return 2 * math.ceil(self.num_kv_heads / tp) * self.head_dim

    def attended_positions(self, context: float) -> float:
        """Positions one query token attends to in a full-attention layer: its context, or DSA's index_topk
        of it."""
        return min(context, self.index_topk) if self.is_dsa else context

    def attended_layer_positions(self, context: float) -> float:
        """Positions one query token attends to, summed over the layers: a sliding layer sees at most
        sliding_window of them (and reads only those: the kernels skip blocks before the window)."""
        sliding = self.num_sliding_layers if self.sliding_window else 0
        return ((self.num_attention_layers - sliding) * self.attended_positions(context)
                + sliding * min(context, self.sliding_window))

    def indexed(self, context: float) -> bool:
        """Whether DSA's indexer scores this context (longer than index_topk; a shorter one is dense)."""
        return self.is_dsa and context > self.index_topk

    def kv_bytes_read_per_token(self, context: float, kv_dtype_bytes: float, tp: int = 1) -> float:
        """Cache bytes one decode token reads over all layers at this context: every position's K/V or latent
        (a sliding layer: its window's only; a linear-attention layer: its state, read and written); under DSA
        every position's index key and only the kept positions' latent rows."""
        return self.kv_bytes_read(context, kv_dtype_bytes, tp)

    def kv_bytes_read(self, context: float, kv_dtype_bytes: float, tp: int = 1, new_tokens: int = 1,
                      phase: str = "decode") -> float:
        """Cache bytes one request's step reads over all layers: `new_tokens` query tokens, the last of which
        sees `context` positions.  A full layer reads every position, a sliding layer the union of its queries'
        windows, min(context, sliding_window + new_tokens - 1) positions (one decode token: its window), a
        linear-attention layer its recurrent state (read and written once a step, whatever new_tokens).  DSA:
        a decode reads as kv_bytes_read_per_token at `context`; a prefill chunk runs dense attention (every
        position's latent and index key)."""
        per_position = self.kv_values_per_token_per_layer(tp) * kv_dtype_bytes
        if self.is_dsa:
            if phase == "prefill":
                return self.num_layers * context * per_position
            latent = self.kv_lora_rank + self.qk_rope_head_dim
            keys = context * self.index_head_dim if self.indexed(context) else 0.0
            return self.num_layers * (keys + self.attended_positions(context) * latent) * kv_dtype_bytes
        sliding = self.num_sliding_layers if self.sliding_window else 0
        positions = ((self.num_attention_layers - sliding) * context
                     + sliding * min(context, self.sliding_window + max(int(new_tokens), 1) - 1))
        return positions * per_position + self.recurrent_state_bytes_per_step(tp)

    def request_kv_bytes(self, tokens: int, block_size: int, kv_dtype_bytes: float, tp: int = 1) -> float:
        """Bytes of KV blocks one request of `tokens` tokens holds at its last step: every block of a full layer,
        a sliding layer's from its window's first block on (the hybrid KV layout gives the others back)."""
        n = -(-int(tokens) // block_size)
        per_layer_block = block_size * self.kv_values_per_token_per_layer(tp) * kv_dtype_bytes
        sliding = self.num_sliding_layers if self.sliding_window else 0
        live = n - max(0, int(tokens) - self.sliding_window) // block_size if sliding else n
        return (per_layer_block * ((self.num_attention_layers - sliding) * n + sliding * live)
                + self.recurrent_state_bytes(tp))

    def kv_bytes_per_token(self, kv_dtype_bytes: float, tp: int = 1) -> float:
        """KV-cache bytes one token occupies on one GPU, summed over all layers (sliding layers included: what
        a token costs while it is inside every window; request_kv_bytes counts the windows)."""
        return self.num_attention_layers * self.kv_values_per_token_per_layer(tp) * kv_dtype_bytes

    # ---- attention FLOPs -------------------------------------------------------------------
    def attention_dims(self, phase: str = "decode") -> tuple:
        if self.is_mla:
            if phase == "decode":
                return self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.head_dim, self.head_dim

    def attention_flops_per_token(self, context: float, phase: str = "decode") -> float:
        """Score + weighted-sum FLOPs for one query token attending to `context` positions, all layers.  DSA:
        the indexer's scores over the whole context (index_n_heads x index_head_dim a position) and attention
        over index_topk positions in decodes (prefill chunks run dense attention under a mask: all of them)."""
        d_qk, d_v = self.attention_dims(phase)
        if self.is_dsa:
            attended = (self.attended_positions(context) if phase == "decode" else context) * self.num_layers
        else:  # sliding layers see their window only, in prefill and decode alike
            attended = self.attended_layer_positions(context)
        flops = 2.0 * attended * self.num_heads * (d_qk + d_v)
        return flops + self.indexer_flops_per_token(context)

    def attention_flops_over(self, start: int, end: int, phase: str = "decode") -> float:
        """attention_flops_per_token(p, phase) summed over p = start + 1 .. end, in closed form: the attention
        FLOPs of one request's new tokens start .. end - 1 (token j attends to j + 1 positions; a sliding layer
        to at most sliding_window of them; DSA's decodes to index_topk, its indexer scoring past index_topk)."""
        if end <= start:
            return 0.0
        d_qk, d_v = self.attention_dims(phase)
        layers = self.num_layers
        if self.is_dsa:
            cap = self.index_topk if phase == "decode" else math.inf
            attended = layers * _positions_sum(start, end, cap)
            above = _positions_sum(start, end, math.inf) - _positions_sum(start, end, self.index_topk) \
                + self.index_topk * _count_above(start, end, self.index_topk)  # sum of the positions past topk
            indexer = 2.0 * above * self.index_n_heads * self.index_head_dim * layers
        else:
            sliding = self.num_sliding_layers if self.sliding_window else 0  # linear-attention layers: none
            attended = ((self.num_attention_layers - sliding) * _positions_sum(start, end, math.inf)
                        + sliding * _positions_sum(start, end, self.sliding_window))
            indexer = 0.0
        return 2.0 * attended * self.num_heads * (d_qk + d_v) + indexer

    def indexer_flops_per_token(self, context: float) -> float:
        """DSA's indexer: one query token's scores over its context (index_n_heads x index_head_dim a position),
        all layers; 0 within index_topk (nothing is scored) or without DSA."""
        if not self.indexed(context):
            return 0.0
        return 2.0 * context * self.index_n_heads * self.index_head_dim * self.num_layers

    def summary(self) -> Dict[str, Any]:
        d = {
            "name": self.name,
            "layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "attention": "mla" if self.is_mla else ("mha" if self.num_kv_heads == self.num_heads else "gqa"),
            "heads": self.num_heads,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "total_params": self.total_params(),
            "active_params": self.active_params(),
        }
        if self.is_mla:
            d["kv_lora_rank"] = self.kv_lora_rank
            d["qk_rope_head_dim"] = self.qk_rope_head_dim
        if self.is_dsa:
            d["sparse_attention"] = (f"DSA: top {self.index_topk} positions, indexer {self.index_n_heads} x "
                                     f"{self.index_head_dim}")
        if self.is_moe:
            d["experts"] = f"{self.num_experts_per_tok}/{self.num_experts}"
        if self.sliding_window and self.num_sliding_layers:
            d["sliding_window"] = f"{self.num_sliding_layers} of {self.num_layers} layers see {self.sliding_window}"
        if self.num_linear_layers:
            d["linear_attention"] = (f"{self.num_linear_layers} of {self.num_layers} layers: Gated DeltaNet, "
                                     f"{self.recurrent_state_bytes() / 2**20:.2f} MiB state per request")
        return d

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Any, name: Optional[str] = None) -> "ModelSpec":
        """Build from a `transformers.PretrainedConfig` or a config.json dict."""
        cfg = _config_to_dict(config)
        get = cfg.get

        hidden = int(get("hidden_size") or get("n_embd") or get("d_model"))
        layers = int(get("num_hidden_layers") or get("n_layer") or get("num_layers"))
        heads = int(get("num_attention_heads") or get("n_head"))
        kv_heads = int(get("num_key_value_heads") or heads)
        head_dim = int(get("head_dim") or hidden // heads)
        vocab = int(get("vocab_size"))
        inter = int(get("intermediate_size") or get("ffn_dim") or get("n_inner") or 4 * hidden)
        tie = bool(get("tie_word_embeddings", False))

        kv_lora = int(get("kv_lora_rank") or 0)
        mla = {}
        if kv_lora:
            mla = dict(
                kv_lora_rank=kv_lora,
                q_lora_rank=int(get("q_lora_rank") or 0),
                qk_nope_head_dim=int(get("qk_nope_head_dim") or 0),
                qk_rope_head_dim=int(get("qk_rope_head_dim") or 0),
                v_head_dim=int(get("v_head_dim") or head_dim),
            )
            head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
            kv_heads = heads
            if get("index_topk"):
                mla.update(index_topk=int(get("index_topk")), index_n_heads=int(get("index_n_heads") or 64),
                           index_head_dim=int(get("index_head_dim") or 128))

        n_experts = int(get("n_routed_experts") or get("num_experts") or get("num_local_experts") or 0)
        moe = {}
        if n_experts:
            moe_inter = int(get("moe_intermediate_size") or inter)
            shared = 0
            if get("n_shared_experts"):
                shared = int(get("n_shared_experts")) * moe_inter
            elif get("shared_expert_intermediate_size"):
                shared = int(get("shared_expert_intermediate_size"))
            moe = dict(
                num_experts=n_experts,
                num_experts_per_tok=int(get("num_experts_per_tok") or get("num_experts_per_token") or 2),
                moe_intermediate_size=moe_inter,
                shared_intermediate_size=shared,
                num_moe_layers=_count_moe_layers(cfg, layers),
                shared_expert_gate=bool(shared) and get("shared_expert_intermediate_size") is not None
                and not get("n_shared_experts"),
            )

        qk_norm = str(get("model_type", "")).startswith("qwen3") or bool(get("use_qk_norm", False))
        window, sliding = _sliding_layers(cfg, layers)
        linear = {}
        if get("linear_num_value_heads"):  # Qwen3-Next: Gated DeltaNet layers beside full attention
            types = get("layer_types")
            if not types:
                interval = int(get("full_attention_interval") or 4)
                types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
            linear = dict(num_linear_layers=sum(1 for t in types if t == "linear_attention"),
                          linear_num_key_heads=int(get("linear_num_key_heads")),
                          linear_num_value_heads=int(get("linear_num_value_heads")),
                          linear_key_head_dim=int(get("linear_key_head_dim")),
                          linear_value_head_dim=int(get("linear_value_head_dim")),
                          linear_conv_kernel=int(get("linear_conv_kernel_dim") or 4), attn_output_gate=True)
        return cls(
            name=name or str(get("_name_or_path") or get("model_type") or "model"),
            num_layers=layers,
            hidden_size=hidden,
            vocab_size=vocab,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            tie_word_embeddings=tie,
            attention_bias=bool(get("attention_bias", False) or get("qkv_bias", False)
                                or str(get("model_type", "")).startswith("qwen2")),
            qk_norm=qk_norm,
            native_dtype=_native_dtype(cfg),
            weight_block_elems=_weight_block_elems(cfg),
            sliding_window=window,
            num_sliding_layers=sliding,
            **mla,
            **moe,
            **linear,
        )


def _positions_sum(start: int, end: int, cap: float) -> float:
    """sum of min(p, cap) over p = start + 1 .. end."""
    tri = lambda x: x * (x + 1) / 2  # noqa: E731
    if end <= cap:
        return tri(end) - tri(start)
    if start >= cap:
        return (end - start) * cap
    return tri(cap) - tri(start) + (end - cap) * cap


def _count_above(start: int, end: int, cap: float) -> int:
    """How many of p = start + 1 .. end exceed cap."""
    return max(0, end - max(start, int(cap)))


def _sliding_layers(cfg: Dict[str, Any], layers: int) -> tuple:
    """(sliding_window, how many layers slide), as the engine reads the config (llama.layer_sliding_window):
    `layer_types`' sliding_attention layers where the config lists them, else every layer when a model-wide
    sliding_window is shorter than max_position_embeddings (Mistral); (0, 0) without a window."""
    window = int(cfg.get("sliding_window") or 0)
    if not window:
        return 0, 0
    types = cfg.get("layer_types")
    if types:
        return window, sum(1 for t in types if t == "sliding_attention")
    if window >= int(cfg.get("max_position_embeddings") or window + 1):
        return 0, 0
    return window, layers


def _config_to_dict(config: Any) -> Dict[str, Any]:
    if isinstance(config, Mapping):
        cfg = dict(config)
        if "text_config" in cfg and "hidden_size" not in cfg:
            cfg = {**cfg, **dict(cfg["text_config"])}
        return cfg
    # transformers.PretrainedConfig (or anything with to_dict)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    for attr in ("head_dim", "num_key_value_heads", "tie_word_embeddings", "vocab_size"):
        if cfg.get(attr) is None and getattr(config, attr, None) is not None:
            cfg[attr] = getattr(config, attr)
    if cfg.get("kv_lora_rank") is None:
        cfg.pop("kv_lora_rank", None)
    return cfg


def _count_moe_layers(cfg: Mapping[str, Any], layers: int) -> int:
    if cfg.get("first_k_dense_replace") is not None:  # DeepSeek: first k layers dense, the rest MoE
        k = int(cfg["first_k_dense_replace"])
        freq = int(cfg.get("moe_layer_freq") or 1)
        return sum(1 for i in range(k, layers) if i % freq == 0)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)  # Qwen-MoE
    return sum(1 for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)


def _weight_block_elems(cfg: Mapping[str, Any]) -> int:
    """Weights sharing one fp32 scale in an FP8 block checkpoint (weight_block_size [128, 128]: 16384)."""
    quant = cfg.get("quantization_config") or {}
    block = quant.get("weight_block_size") if isinstance(quant, Mapping) else None
    if isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return block[0] * block[1]
    return 0


def _native_dtype(cfg: Mapping[str, Any]) -> str:
    quant = cfg.get("quantization_config") or {}
    if isinstance(quant, Mapping) and "fp8" in str(quant.get("quant_method", "")).lower():
        return "fp8"
    dt = cfg.get("torch_dtype") or cfg.get("dtype")
    if dt:
        try:
            return normalize_dtype(str(dt))
        except ValueError:
            pass
    return "bf16"


# --------------------------------------------------------------------------------------------
# Presets: the published config.json fields that matter for cost (no download needed).
# --------------------------------------------------------------------------------------------
MODEL_PRESETS: Dict[str, Dict[str, Any]] = {
    "llama-2-7b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False,
        torch_dtype="float16",
    ),
    "llama-3-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    "llama-3-70b": dict(
        model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    "qwen3-8b": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=False, attention_bias=False, torch_dtype="bfloat16",
    ),
    "deepseek-v3": dict(
        model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        vocab_size=129280, tie_word_embeddings=False, torch_dtype="bfloat16",
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
    ),
    "deepseek-v3.2": dict(
        model_type="deepseek_v32", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        index_topk=2048, index_n_heads=64, index_head_dim=128,
        vocab_size=129280, tie_word_embeddings=False, torch_dtype="bfloat16",
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
    ),
    # roofline's default model (SmolLM2-135M-Instruct)
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
}

_MODEL_ALIASES = {
    "llama2-7b": "llama-2-7b", "meta-llama/llama-2-7b-hf": "llama-2-7b",
    "llama3-8b": "llama-3-8b", "meta-llama/meta-llama-3-8b": "llama-3-8b", "llama-3.1-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b", "meta-llama/meta-llama-3-70b": "llama-3-70b", "llama-3.1-70b": "llama-3-70b",
    "qwen/qwen3-8b": "qwen3-8b",
    "deepseek-ai/deepseek-v3": "deepseek-v3", "deepseek-v3-0324": "deepseek-v3", "deepseek-r1": "deepseek-v3",
    "smollm2-135m-instruct": "smollm2-135m", "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
    "default": "smollm2-135m",
}

DEFAULT_MODEL = "smollm2-135m"


def read_config_dir(path: str) -> Dict[str, Any]:
    """config.json of a local HF model directory, via transformers.AutoConfig when it knows the
    architecture, else parsed as plain JSON."""
    cfg_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"no config.json in {path!r}")
    with open(cfg_file) as f:
        raw = json.load(f)
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(cfg_file)), local_files_only=True)
        cfg = _config_to_dict(hf)
        # keep raw keys AutoConfig may drop or rename (e.g. quantization_config)
        for k, v in raw.items():
            cfg.setdefault(k, v)
        return cfg
    except Exception:  # unknown model_type, remote code, etc.: the JSON is enough
        return raw


def load_model_spec(model: Optional[str]) -> ModelSpec:
    """A preset name (see MODEL_PRESETS), or a local directory / config.json path."""
    if model is None:
        model = DEFAULT_MODEL
    if os.path.exists(model):
        name = os.path.basename(os.path.normpath(model if os.path.isdir(model) else os.path.dirname(model)))
        return ModelSpec.from_hf_config(read_config_dir(model), name=name)
    key = model.strip().lower()
    key = _MODEL_ALIASES.get(key, key)
    if key not in MODEL_PRESETS:
        raise ValueError(f"unknown model {model!r}: not a directory and not a preset "
                         f"({', '.join(sorted(MODEL_PRESETS))})")
    return ModelSpec.from_hf_config(MODEL_PRESETS[key], name=key)
