"""The Llama family: Llama 2/3/3.1, Mistral, SmolLM (LlamaForCausalLM), Qwen2 (qkv bias), Qwen3
(per-head q/k RMSNorm), SmolLM3 (layers without rope: `no_rope_layers`) and Granite (embedding, attention
and residual multipliers, logits scaling).  One flat batch of N tokens from many requests goes through:

    x [N x d] = embed(input_ids)
    per layer:  h = RMSNorm(x); qkv = h W_qkv [N x (H + 2 H_kv) D]; q, k = rope(q, k, positions)
                write k, v into the paged cache at slot_mapping; o = attention(q, cache, block tables)
                x = x + o W_o;  x = x + down(silu(gate(h')) * up(h'))   with h' = RMSNorm(x)
    logits [T x V] = RMSNorm(x)[sample rows] W_lm^T
The last layer drops the rows nobody reads once its attention has written and read the cache: a
prefill chunk needs the hidden state of its last row only (unless prompt logprobs are asked for), so
its O projection, MLP and final norm run on the wanted rows alone (`output_rows`).

Pipeline parallelism (distributed/pipeline.py): a stage builds only its layers [start, end) (the
others are MissingLayer), the first stage the embedding, the last the final norm and LM head; a stage
other than the first starts from the previous stage's (hidden, residual), one other than the last
returns them instead of the normed hidden states.
"""

from __future__ import annotations

import re

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from roofline.attention import kv_spec
from roofline.attention.backend import PLAIN, AttentionBackend, AttentionMetadata, AttentionOptions
from roofline.distributed import pipeline
from roofline.cpu import gemm as cpu_gemm
from roofline.model_executor.layers.activation import SiluAndMul
from roofline.model_executor.layers.quantization import is_quantized
from roofline.model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from roofline.model_executor.layers.norm import RMSNorm
from roofline.model_executor.layers.rotary import RotaryEmbedding, rope_parameters
from roofline.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding


LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_sliding_window(config, layer_idx: int) -> Optional[int]:
    """How many keys layer layer_idx's queries see (None: all), as HF reads the config: `layer_types` where
    the config has it (a "sliding_attention" layer sees `sliding_window` keys; an entry we cannot honour is a
    start-up error naming it), else `sliding_window` for every layer (Mistral, Mixtral).  A window no shorter
    than max_position_embeddings is no window."""
    types = getattr(config, "layer_types", None)
    if types:
        if len(types) != config.num_hidden_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types entries {unknown} are not supported; supported: {list(LAYER_TYPES)}")
        if types[layer_idx] != "sliding_attention":
            return None
        if not getattr(config, "sliding_window", None):
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    window = getattr(config, "sliding_window", None) or None
    if window is not None and window >= getattr(config, "max_position_embeddings", window + 1):
        return None  # no position is that far from another: plain causal attention
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend, qk_norm: bool, bias: bool, o_bias: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias)
        self.scale = self.head_dim**-0.5
        rope = rope_parameters(config)
        # HF 5 keeps partial_rotary_factor in the rope dict (Phi-4-mini); older configs at the top level
        partial = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope,
                                      rotary_dim=int(self.head_dim * partial))
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        no_rope = getattr(config, "no_rope_layers", None)  # SmolLM3: 1 = this layer ropes, 0 = it does not
        self.use_rope = bool(no_rope[layer_idx]) if no_rope is not None else True
        window = layer_sliding_window(config, layer_idx)
        # sliding window (Mistral, layer_types' sliding layers), soft-cap and sinks (Gemma, gpt-oss add theirs)
        self.attn_options = PLAIN if window is None else AttentionOptions(sliding_window=window)

    def kv_cache_spec(self) -> kv_spec.KVCacheSpec:
        """K and V of this rank's KV heads (the backend's [2, blocks, block_size, H_kv, D] layout)."""
        return kv_spec.attention_spec(self.num_kv_heads, self.head_dim, self.attn_options.sliding_window or 0)

    def forward(self, positions, x, kv_cache: torch.Tensor, meta: AttentionMetadata, cos_sin=None,
                keep: Optional[torch.Tensor] = None):
        """keep: only these rows' outputs are returned (the O projection runs on them alone)."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)  # [N, (H + 2 H_kv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.rotary(positions, q, k, cos_sin)
        self.backend.write_kv(k, v, kv_cache, meta.slot_mapping)
        o = self.backend.forward(q, kv_cache, meta, self.scale, self.attn_options).reshape(n, self.q_size)  # [N, H D]
        return self.o_proj(o if keep is None else o[keep])


class LlamaMLP(nn.Module):
    def __init__(self, config, intermediate_size: Optional[int] = None, reduce_results: bool = True):
        """intermediate_size: config.intermediate_size unless given (an MoE model's shared expert);
        reduce_results=False leaves the tensor-parallel partial sums un-reduced (the caller reduces)."""
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        width = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [width] * 2, bias=bias)
        self.down_proj = RowParallelLinear(width, config.hidden_size, bias=bias, reduce_results=reduce_results)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        self.act = SiluAndMul()

    def forward(self, x):
        h = cpu_gemm.gate_up_silu(x, self.gate_up_proj)  # fused on CPU where it applies
        if h is None:
            h = self.act(self.gate_up_proj(x))
        return self.down_proj(h)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention  # a family's own attention, built with the same arguments (gpt-oss: sinks)

    def __init__(self, config, layer_idx: int, backend: AttentionBackend, qk_norm: bool, qkv_bias: bool, o_bias: bool,
                 make_mlp: Callable[[object, int], nn.Module]):
        """make_mlp(config, layer_idx): the layer's feed-forward block, x [N, d] -> [N, d] (LlamaMLP, or a
        mixture of experts); built after the attention, whose split errors come first."""
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, backend, qk_norm, qkv_bias, o_bias)
        self.mlp = make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = 1.0  # Granite: each block's output scaled before it joins the residual

    def forward(self, positions, x, residual: Optional[torch.Tensor], kv_cache, meta, cos_sin=None,
                keep: Optional[torch.Tensor] = None):
        """keep: row indices; every row's K/V still goes to the cache, but only these rows come out."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta, cos_sin, keep)
        if keep is not None:
            residual = residual[keep]
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        return (h * self.residual_multiplier if self.residual_multiplier != 1.0 else h), residual


class LlamaModel(nn.Module):
    def __init__(self, config, backend: AttentionBackend, qk_norm: bool, qkv_bias: bool, o_bias: bool,
                 make_mlp: Callable[[object, int], nn.Module], layer_cls=None):
        """make_mlp(config, layer_idx): each layer's feed-forward block; layer_cls: the decoder layer
        (LlamaDecoderLayer unless a family brings its own, called with the same arguments)."""
        layer_cls = layer_cls or LlamaDecoderLayer
        super().__init__()
        self.start_layer, self.end_layer = pipeline.stage_layers(config.num_hidden_layers)
        self.is_first_stage, self.is_last_stage = pipeline.is_first_stage(), pipeline.is_last_stage()
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size) if self.is_first_stage
                             else pipeline.MissingLayer())
        self.layers = nn.ModuleList(
            layer_cls(config, i, backend, qk_norm, qkv_bias, o_bias, make_mlp)
            if self.start_layer <= i < self.end_layer else pipeline.MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else pipeline.MissingLayer()
        self.cpu_stack = None  # llama_cpu_stack.CpuLayerStack where it applies (set after loading, CPU)
        self.embedding_multiplier = 1.0  # Granite: the embeddings scaled

    def _last_layer_quantized(self) -> list:
        """The quantized weights (GGUF or FP8 blocks) of the stage's last layer (the rows it keeps run its
        projections after attention)."""
        if self.end_layer <= self.start_layer:
            return []
        return [m.quant for m in self.layers[self.end_layer - 1].modules() if getattr(m, "quant", None) is not None]

    @property
    def stage_layers(self) -> list["LlamaDecoderLayer"]:
        """This pipeline stage's layers, in order (every layer without pipeline parallelism)."""
        return [self.layers[i] for i in range(self.start_layer, self.end_layer)]  # (a slice builds a ModuleList)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                output_rows: Optional[torch.Tensor] = None,
                intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """-> [N, d] final hidden states, or [K, d] for output_rows (K increasing row indices) alone:
        rows nobody reads (a prefill chunk's, but the last) leave the last layer after its attention.
        Pipeline stages: `intermediate` is the previous stage's (hidden, residual) [N, d] each (not on
        the first stage); a stage other than the last returns its (hidden, residual)."""
        if self.is_first_stage:
            x, residual = self.embed_tokens(input_ids), None
            if self.embedding_multiplier != 1.0:
                x = x * self.embedding_multiplier
        else:
            x, residual = intermediate
        keep = output_rows if self.is_last_stage else None
        if (keep is not None and x.is_cpu and keep.shape[0] != x.shape[0]
                and not cpu_gemm.routes_alike(x.shape[0], keep.shape[0], self._last_layer_quantized())):
            keep = None  # the kept rows would take another route than their batch's: taken after the norm instead
        # every layer shares one rope table: look it up once per step, not once per layer
        cos_sin = (self.layers[self.start_layer].self_attn.rotary.cos_sin(positions, x.dtype)
                   if self.end_layer > self.start_layer else None)
        if self.cpu_stack is not None and self.cpu_stack.takes(x):
            x = self.cpu_stack(x, cos_sin, kv_caches, meta, keep)  # the same kernels, called from C
        else:
            layers = self.stage_layers
            last = len(layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
                x, residual = layer(positions, x, residual, kv_cache, meta.for_layer(self.start_layer + i), cos_sin,
                                    keep if i == last else None)
            if not self.is_last_stage:
                return x, residual
            if keep is not None and not layers:
                x = x[keep]
            x, _ = self.norm(x, residual)
        return x if output_rows is None or keep is not None else x[output_rows]


def _dense(tensor) -> torch.Tensor:
    """A checkpoint tensor as a dense tensor (GGUF blocks dequantized)."""
    return tensor.dequantize() if is_quantized(tensor) else tensor


class LlamaForCausalLM(nn.Module):
    supports_kv_groups = True  # layers read AttentionMetadata.for_layer (a hybrid KV layout's group tables)
    keeps_quantized_weights = True  # load_weights takes gguf_quant.QuantizedTensor (linear layers keep blocks)
    decoder_layer_cls = None  # LlamaDecoderLayer (OLMo 2 brings its own post-norm layer)
    qk_norm = False
    qkv_bias_default = False
    o_bias_follows_qkv = True  # Llama/Qwen3: o_proj has a bias iff attention_bias; Qwen2: never
    supports_lora = True  # roofline/lora: PEFT adapters on the projections (mapped through stacked_params)

    # checkpoint name fragment -> (our parameter fragment, shard id)
    stacked_params = [
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    ]

    def __init__(self, config, backend: AttentionBackend):
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias(config)
        o_bias = qkv_bias and self.o_bias_follows_qkv
        self.attention_backend = backend
        self.model = LlamaModel(config, backend, self.qk_norm, qkv_bias, o_bias, self.make_mlp, self.decoder_layer_cls)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        inner = self.model
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size) if inner.is_last_stage
                        else pipeline.MissingLayer())
        if self.tie_word_embeddings and inner.is_first_stage and inner.is_last_stage:
            self.lm_head.weight = inner.embed_tokens.weight

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", self.qkv_bias_default))

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        """Layer layer_idx's feed-forward block (mixture-of-experts models override this)."""
        return LlamaMLP(config)

    def forward(self, input_ids, positions, kv_caches, meta, output_rows: Optional[torch.Tensor] = None,
                intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        stage_input = {} if intermediate is None else {"intermediate": intermediate}  # pipeline stages after the first
        return self.model(input_ids, positions, kv_caches, meta, output_rows, **stage_input)

    def kv_cache_specs(self) -> list[kv_spec.KVCacheSpec]:
        """What each of this stage's layers caches, in layer order (the worker sizes and allocates the
        pool from it)."""
        return [layer.self_attn.kv_cache_spec() for layer in self.model.stage_layers]

    def holds_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this pipeline stage."""
        inner = self.model
        m = _LAYER_NAME.match(name)
        if m is not None:
            return inner.start_layer <= int(m[1]) < inner.end_layer
        if name.startswith("model.embed_tokens."):
            return inner.is_first_stage
        if name.startswith(("model.norm.", "lm_head.")):
            return inner.is_last_stage
        return True

    logits_divisor = 1.0  # Granite's logits_scaling (positive: greedy tokens are the unscaled logits' argmax)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        return logits / self.logits_divisor if self.logits_divisor != 1.0 else logits

    def greedy_tokens(self, hidden: torch.Tensor, rows: list[int]) -> Optional[torch.Tensor]:
        """compute_logits(hidden[rows]).argmax(-1) where the LM head can skip the full logits, else None."""
        return self.lm_head.greedy_tokens(hidden, rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors named as in HF; returns the parameters that were filled."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        inner = self.model
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # tied to the embedding
            if self.tie_word_embeddings and inner.is_last_stage and not inner.is_first_stage \
                    and name == "model.embed_tokens.weight":
                name = "lm_head.weight"  # the last stage holds the tied LM head without the embedding
            elif not self.holds_tensor(name):
                continue  # another pipeline stage's
            target = self._load_tensor(name, tensor, params)
            if target is not None:
                loaded.add(target)
        if self.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded

    def _load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> Optional[str]:
        return load_named_tensor(self, name, tensor, params, self.stacked_params)


def load_named_tensor(model: nn.Module, name: str, tensor, params: dict[str, nn.Parameter],
                      stacked_params) -> Optional[str]:
    """Copy one checkpoint tensor into model's parameter of that name (this rank's slice); returns the
    parameter's name (None: a stacked part this model does not hold).  stacked_params: (checkpoint name
    fragment, our fragment, shard) for projections stored fused (gate/up -> gate_up_proj).  A GGUF tensor
    kept in blocks (gguf_quant.QuantizedTensor: keeps_quantized_weights) goes to its linear layer's
    load_weight; anywhere else it is dequantized."""
    def owner_of(param_name: str) -> nn.Module:
        return model.get_submodule(param_name.rsplit(".", 1)[0])

    for frag, ours, shard in stacked_params:
        if frag in name:
            target = name.replace(frag, ours)
            if target not in params:
                return None
            owner = owner_of(target)
            if isinstance(owner, LinearBase) and target.endswith(".weight"):
                load_into_linear(owner, name, tensor, shard)
            else:
                p = params[target]
                owner.weight_loader(p, _dense(tensor).to(p.dtype), shard)
            return target
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
    owner = owner_of(name)
    if isinstance(owner, LinearBase) and name.endswith(".weight"):
        load_into_linear(owner, name, tensor)
        return name
    tensor = _dense(tensor)
    p = params[name]
    if hasattr(owner, "weight_loader"):
        owner.weight_loader(p, tensor.to(p.dtype))
    else:
        p.data.copy_(tensor.to(p.dtype))
    return name


def load_into_linear(layer: LinearBase, name: str, tensor, shard=None) -> None:
    """layer.load_weight, its errors (a tensor-parallel shard that cuts an FP8 block, ...) naming the tensor."""
    try:
        layer.load_weight(tensor, shard)
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from e


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True
    o_bias_follows_qkv = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class MistralForCausalLM(LlamaForCausalLM):
    pass


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama with every `no_rope_layer_interval`-th layer attending without rope (no_rope_layers); its
    sliding layers (use_sliding_window) follow layer_types like every Llama-family model's."""

    def __init__(self, config, backend: AttentionBackend):
        no_rope = getattr(config, "no_rope_layers", None)
        if no_rope is not None and len(no_rope) != config.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(no_rope)} entries for {config.num_hidden_layers} layers")
        super().__init__(config, backend)


class GraniteForCausalLM(LlamaForCausalLM):
    """IBM Granite (3.x): Llama with embedding_multiplier, attention_multiplier (the softmax scale),
    residual_multiplier (each block's output before the residual add) and logits_scaling (logits divided)."""

    def __init__(self, config, backend: AttentionBackend):
        super().__init__(config, backend)
        scaling = float(getattr(config, "logits_scaling", 1.0))
        if scaling <= 0:
            raise ValueError(f"logits_scaling must be positive, got {scaling}")
        self.logits_divisor = scaling
        self.model.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))
        for layer in self.model.stage_layers:
            layer.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))
            layer.self_attn.scale = float(getattr(config, "attention_multiplier", layer.self_attn.scale))
