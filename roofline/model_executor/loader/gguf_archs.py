"""llama.cpp GGUF files of the families roofline maps itself: gemma2, gemma3 (text), phi3, olmo2, granite,
glm4moe, smollm3 and gpt-oss -- the HF config built from the file's metadata, and each tensor's HF name.

transformers reads none of these faithfully (it has no olmo2 / granite / glm4moe / smollm3 reader; its
gemma2 / gemma3 / phi3 ones drop the soft-caps, the per-layer-type rope, LongRoPE's factor tensors, the
partial rope and the pretraining window), so the config is rebuilt here as llama.cpp reads the same keys
(its hparams loading and defaults), from what the converter (convert_hf_to_gguf.py) writes:

  * every `<arch>.*` key is either honoured (mapped to the config, or checked to equal what the config
    implies) or a start-up error naming it; `general.*` and `quantize.*` (provenance) are not read and
    `tokenizer.*` builds the tokenizer;
  * every tensor of the file maps to an HF parameter name, is consumed by the config (Phi-3's
    rope_factors_long / rope_factors_short -> LongRoPE's long_factor / short_factor), or is a GLM-4.5
    multi-token-prediction block (skipped, as for safetensors); any other tensor is a start-up error;
  * what the converter changed is undone: Gemma's norms are stored as 1 + w (GemmaRMSNorm loads w as
    1 + w, so the GGUF value less 1 is handed on); Granite and SmolLM3 (the converter's LlamaModel
    subclasses) have their q/k rows (weights and biases) permuted to llama.cpp's interleaved rope
    pairs, undone by the loader; Phi-3's fused attn_qkv and ffn_up (gate rows then up rows) are HF's
    fused qkv_proj / gate_up_proj; GLM-4.5's block count includes its MTP layers
    (nextn_predict_layers), which are not part of num_hidden_layers; gpt-oss's interleaved gate_up_proj
    is stored as two expert stacks (ffn_gate_exps: HF's even rows, ffn_up_exps: its odd ones, likewise
    the biases), down_proj transposed to [E, H, I] as ffn_down_exps, the sinks as attn_sinks.weight; its
    MXFP4 expert blocks are repacked to ggml's MXFP4 (the exponent byte, then 16 bytes whose low nibbles
    are values 0-15 and high nibbles 16-31) -- weights.py turns them back into HF's blocks and
    dequantizes them with quantization/mxfp4.py, so the values are HF's bit for bit.

What llama.cpp fixes rather than stores is fixed the same way: Gemma 2 alternates sliding and global
layers (even layers slide), Gemma 3 has five sliding layers then a global one, its sliding layers rope
with base 10000 (or rope.freq_base_swa) unscaled; the attention scale of both is head_dim^-1/2, or
(hidden / heads)^-1/2 for the 27B models (46 / 62 layers), as llama.cpp derives query_pre_attn_scalar;
SmolLM3 skips the rope on every 4th layer. gpt-oss alternates sliding and full layers (even layers slide),
its clamped SwiGLU has llama.cpp's fixed alpha 1.702 and limit 7.0 (the release's values), its router
takes top-k then a softmax over those k, its attention scale is head_dim^-1/2; its YaRN is HF gpt-oss's
(`truncate` false: the correction range is not rounded, as llama.cpp's generic YaRN rounds it -- the file
comes from an HF gpt-oss model, whose function is served).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

# bump when a mapping changes: cached configs (source.gguf_metadata_dir) are keyed by it
MAPPING_VERSION = 1

_REQUIRED = object()
_TOKEN_IDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id")
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")

# llama.cpp block name -> HF module path inside model.layers.<i>
_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_GEMMA_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


@dataclass(frozen=True)
class GgufArch:
    """How one llama.cpp architecture maps: its config builder, its per-layer tensor names, and what the
    converter did to the tensors."""

    config: Callable[["_Metadata"], dict]
    layer_tensors: dict[str, str]
    permute_qk: bool = False  # llama.cpp's LlamaModel.permute on q/k rows (weights and biases)
    norm_plus_one: bool = False  # every *norm.weight stored as 1 + w
    tied_only: bool = False  # no output.weight: the LM head is the embedding
    config_tensors: tuple[str, ...] = ()  # tensors the config consumes (not parameters)
    mtp_blocks: bool = False  # blocks past num_hidden_layers are multi-token-prediction layers (skipped)
    leafless: tuple[str, ...] = ()  # block tensors `<part>.weight` whose HF parameter is `<module path>` itself


class _Metadata:
    """The file's metadata with the keys under `<arch>.` read through get(); unread() lists those no
    builder consumed (each a start-up error)."""

    def __init__(self, arch: str, metadata: dict, tensors: dict[str, tuple[int, ...]], path: str):
        self.arch, self.metadata, self.tensors, self.path = arch, metadata, tensors, path
        self.read: set[str] = set()
        self.tensor_values: dict[str, list[float]] = {}  # the config tensors' values (Phi-3's rope factors)

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def has(self, name: str) -> bool:
        return self.key(name) in self.metadata

    def get(self, name: str, default: Any = _REQUIRED) -> Any:
        key = self.key(name)
        self.read.add(key)
        if key not in self.metadata:
            if default is _REQUIRED:
                raise ValueError(f"GGUF file {self.path}: required metadata key {key!r} is missing")
            return default
        value = self.metadata[key]
        if isinstance(value, list):  # per-layer arrays: one value for every layer is the only kind served
            if not value or any(v != value[0] for v in value):
                raise ValueError(f"GGUF metadata {key!r} = {value!r}: per-layer values that differ are not "
                                 f"supported for {self.arch}")
            value = value[0]
        return value

    def refuse(self, name: str, why: str) -> None:
        key = self.key(name)
        raise ValueError(f"GGUF metadata {key!r} = {self.metadata.get(key)!r} cannot be honoured: {why}")

    def unread(self) -> list[str]:
        return sorted(k for k in self.metadata if k.startswith(self.arch + ".") and k not in self.read)

    def layer_has(self, part: str) -> bool:
        """Whether any block holds tensor `blk.<i>.<part>` (e.g. 'attn_q.bias')."""
        return any(re.match(rf"^blk\.\d+\.{re.escape(part)}$", n) for n in self.tensors)


# ---- the common part of every config ------------------------------------------------------------------

def _common(m: _Metadata, head_dim_key: bool = True) -> dict:
    """Sizes, norm epsilon, vocabulary (token_embd's rows), tied head and special tokens, as llama.cpp's
    generic hparams loading reads them (defaults: kv heads = heads, head_dim = hidden / heads)."""
    hidden = int(m.get("embedding_length"))
    heads = int(m.get("attention.head_count"))
    kv = int(m.get("attention.head_count_kv", heads))
    head_dim = int(m.get("attention.key_length", hidden // heads)) if head_dim_key else hidden // heads
    if not head_dim_key and m.has("attention.key_length") and m.get("attention.key_length") != head_dim:
        m.refuse("attention.key_length", f"this architecture's head size is hidden / heads = {head_dim}")
    if m.get("attention.value_length", head_dim) != head_dim:
        m.refuse("attention.value_length", f"values of another width than the keys ({head_dim})")
    if "token_embd.weight" not in m.tensors:
        raise ValueError(f"GGUF file {m.path} has no token_embd.weight tensor")
    vocab = m.tensors["token_embd.weight"][0]
    if m.get("vocab_size", vocab) != vocab:
        m.refuse("vocab_size", f"token_embd.weight has {vocab} rows")
    if not m.get("rope.scaling.finetuned", True) and m.arch == "granite":
        m.refuse("rope.scaling.finetuned", "a Granite model without rope is not supported")
    if m.get("attention.causal", True) is not True:
        m.refuse("attention.causal", "only causal attention is served")
    cfg = dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=int(m.get("block_count")),
        intermediate_size=int(m.get("feed_forward_length")),
        max_position_embeddings=int(m.get("context_length")),
        rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon")),
        vocab_size=vocab,
        tie_word_embeddings="output.weight" not in m.tensors,
        bos_token_id=m.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=m.metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=m.metadata.get("tokenizer.ggml.padding_token_id"),
    )
    if head_dim_key:
        cfg["head_dim"] = head_dim
    return cfg


def _rope(m: _Metadata) -> dict:
    """rope_theta (llama.cpp's default base 10000) and the scaling llama.cpp applies from rope.scaling.type /
    factor: none, or linear (the type llama.cpp assumes when only a factor is given); other types are
    refused."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.get("rope.freq_base", 10000.0))}
    kind = m.get("rope.scaling.type", None)
    factor = float(m.get("rope.scaling.factor", 0.0))
    if kind not in (None, "none", "linear"):
        m.refuse("rope.scaling.type", "only rope scaling 'none' and 'linear' are mapped for this architecture")
    if kind != "none" and factor not in (0.0, 1.0):
        params.update(rope_type="linear", factor=factor)
    return params


def _full_rope(m: _Metadata, head_dim: int) -> None:
    if m.get("rope.dimension_count", head_dim) != head_dim:
        m.refuse("rope.dimension_count", f"this architecture ropes the whole head ({head_dim})")


def _refuse_sliding_window(m: _Metadata, why: str) -> None:
    if m.get("attention.sliding_window", 0):
        m.refuse("attention.sliding_window", why)
    if m.has("attention.sliding_window_pattern"):
        m.refuse("attention.sliding_window_pattern", why)


# ---- one builder per architecture ---------------------------------------------------------------------

def _gemma_scalar(m: _Metadata, cfg: dict, layers_27b: int) -> int:
    """llama.cpp's query_pre_attn_scalar: hidden / heads for the 27B model (recognised by its layer count),
    head_dim otherwise (the file stores no attention scale for Gemma)."""
    if cfg["num_hidden_layers"] == layers_27b:
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["head_dim"]


def _gemma2(m: _Metadata) -> dict:
    cfg = _common(m)
    _full_rope(m, cfg["head_dim"])
    window = int(m.get("attention.sliding_window", 4096))  # llama.cpp's default for Gemma 2
    if window <= 0:
        m.refuse("attention.sliding_window", "Gemma 2's sliding layers need a window")
    n = cfg["num_hidden_layers"]
    cfg.update(
        model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_activation="gelu_pytorch_tanh",
        rope_parameters=_rope(m),
        sliding_window=window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        attn_logit_softcapping=float(m.get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(m.get("final_logit_softcapping", 30.0)),
        query_pre_attn_scalar=_gemma_scalar(m, cfg, 46),
    )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg[key] == 0.0:
            cfg[key] = None
    return cfg


def _gemma3(m: _Metadata) -> dict:
    cfg = _common(m)
    _full_rope(m, cfg["head_dim"])
    n = cfg["num_hidden_layers"]
    window = int(m.get("attention.sliding_window", 0))
    if window > 0:  # llama.cpp: five sliding layers, then a global one
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    else:
        types, window = ["full_attention"] * n, None
    local = {"rope_type": "default", "rope_theta": float(m.get("rope.freq_base_swa", 10000.0))}
    cap = float(m.get("final_logit_softcapping", 0.0))
    cfg.update(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_activation="gelu_pytorch_tanh",
        sliding_window=window, layer_types=types,
        rope_parameters={"full_attention": _rope(m), "sliding_attention": local},
        final_logit_softcapping=cap or None, attn_logit_softcapping=None,
        query_pre_attn_scalar=_gemma_scalar(m, cfg, 62),
    )
    return cfg


def _phi3(m: _Metadata) -> dict:
    cfg = _common(m, head_dim_key=False)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary = int(m.get("rope.dimension_count", head_dim))
    original = int(m.get("rope.scaling.original_context_length", cfg["max_position_embeddings"]))
    rope = _rope(m)
    if rope["rope_type"] != "default":
        m.refuse("rope.scaling.type", "Phi-3 files carry LongRoPE as rope_factors tensors, no other scaling")
    long_, short = m.tensors.get("rope_factors_long.weight"), m.tensors.get("rope_factors_short.weight")
    if (long_ is None) != (short is None):
        missing = "rope_factors_short.weight" if short is None else "rope_factors_long.weight"
        raise ValueError(f"GGUF file {m.path}: LongRoPE needs both factor tensors; {missing} is missing")
    if long_ is not None:
        factors = m.tensor_values
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            if len(factors[name]) != rotary // 2:
                raise ValueError(f"GGUF tensor {name} has {len(factors[name])} values; the rotary dimension "
                                 f"{rotary} needs {rotary // 2}")
        rope.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                    short_factor=factors["rope_factors_short.weight"],
                    original_max_position_embeddings=original)
        attn = m.get("rope.scaling.attn_factor", None)
        if attn is not None:
            rope["attention_factor"] = float(attn)
    elif m.has("rope.scaling.attn_factor"):
        m.refuse("rope.scaling.attn_factor", "an attention factor without the LongRoPE factor tensors")
    window = int(m.get("attention.sliding_window", 0))  # the converter writes 0 for none
    cfg.update(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_act="silu", rope_parameters=rope,
               partial_rotary_factor=rotary / head_dim, original_max_position_embeddings=original,
               sliding_window=window or None)
    if rotary != head_dim:
        rope["partial_rotary_factor"] = rotary / head_dim
    return cfg


def _olmo2(m: _Metadata) -> dict:
    cfg = _common(m)
    _full_rope(m, cfg["head_dim"])
    _refuse_sliding_window(m, "sliding-window attention (an OLMo 3 file) is not supported; OLMo 2 has none")
    cfg.update(model_type="olmo2", architectures=["Olmo2ForCausalLM"], hidden_act="silu", rope_parameters=_rope(m),
               attention_bias=m.layer_has("attn_q.bias"))
    return cfg


def _granite(m: _Metadata) -> dict:
    cfg = _common(m, head_dim_key=False)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    _full_rope(m, head_dim)
    # llama.cpp: logit_scale required; a scale of 0 (or absent) leaves that step out
    cfg.update(
        model_type="granite", architectures=["GraniteForCausalLM"], hidden_act="silu", rope_parameters=_rope(m),
        logits_scaling=float(m.get("logit_scale")),
        embedding_multiplier=float(m.get("embedding_scale", 0.0)) or 1.0,
        residual_multiplier=float(m.get("residual_scale", 0.0)) or 1.0,
        attention_multiplier=float(m.get("attention.scale", 0.0)) or head_dim ** -0.5,
        attention_bias=m.layer_has("attn_q.bias"), mlp_bias=m.layer_has("ffn_up.bias"),
    )
    return cfg


def _smollm3(m: _Metadata) -> dict:
    cfg = _common(m)
    _full_rope(m, cfg["head_dim"])
    _refuse_sliding_window(m, "SmolLM3 files are served without sliding windows")
    cfg.update(model_type="smollm3", architectures=["SmolLM3ForCausalLM"], hidden_act="silu",
               rope_parameters=_rope(m), no_rope_layer_interval=4, use_sliding_window=False, sliding_window=None,
               attention_bias=m.layer_has("attn_q.bias"), mlp_bias=m.layer_has("ffn_up.bias"))
    return cfg


def _glm4moe(m: _Metadata) -> dict:
    cfg = _common(m)
    head_dim = cfg["head_dim"]
    rotary = int(m.get("rope.dimension_count", head_dim))
    if m.has("rope.dimension_sections"):
        m.refuse("rope.dimension_sections", "multimodal rope (GLM-4.5V) is not supported")
    gating = int(m.get("expert_gating_func", 0))
    if gating not in (0, 2):  # llama.cpp: none -> sigmoid; GLM-4.5's router is sigmoid
        m.refuse("expert_gating_func", "GLM-4.5's router scores with a sigmoid (2)")
    nextn = int(m.get("nextn_predict_layers", 0))
    rope = _rope(m)
    rope["partial_rotary_factor"] = rotary / head_dim
    cfg.update(
        model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], hidden_act="silu", rope_parameters=rope,
        partial_rotary_factor=rotary / head_dim,
        num_hidden_layers=cfg["num_hidden_layers"] - nextn, num_nextn_predict_layers=nextn,
        n_routed_experts=int(m.get("expert_count")), num_experts_per_tok=int(m.get("expert_used_count")),
        moe_intermediate_size=int(m.get("expert_feed_forward_length")),
        n_shared_experts=int(m.get("expert_shared_count")),
        first_k_dense_replace=int(m.get("leading_dense_block_count", 0)),
        routed_scaling_factor=float(m.get("expert_weights_scale", 0.0)) or 1.0,
        norm_topk_prob=bool(m.get("expert_weights_norm", False)),
        n_group=int(m.get("expert_group_count", 1)), topk_group=int(m.get("expert_group_used_count", 1)),
        use_qk_norm=m.layer_has("attn_q_norm.weight"), attention_bias=m.layer_has("attn_q.bias"),
    )
    return cfg


def _yarn_or_plain_rope(m: _Metadata, context: int) -> dict:
    """_rope's none / linear, or YaRN as HF computes it from what llama.cpp reads: rope.scaling.factor,
    original_context_length (default: the training context), yarn_beta_fast / _slow (llama.cpp's defaults
    32 / 1); llama.cpp's ext_factor other than 1, an attention factor other than 1 (llama.cpp multiplies
    it into its 1 + 0.1 ln(factor), HF takes an explicit one as the whole factor) and a log multiplier have
    no HF counterpart here and are refused."""
    if m.get("rope.scaling.type", None) != "yarn":
        return _rope(m)
    factor = float(m.get("rope.scaling.factor", 0.0)) or 1.0
    for key, neutral in (("rope.scaling.yarn_ext_factor", 1.0), ("rope.scaling.yarn_attn_factor", 1.0),
                         ("rope.scaling.yarn_log_multiplier", 0.0)):
        if float(m.get(key, neutral)) != neutral:
            m.refuse(key, f"only {neutral} maps to HF's YaRN")
    return {"rope_type": "yarn", "rope_theta": float(m.get("rope.freq_base", 10000.0)), "factor": factor,
            "original_max_position_embeddings": int(m.get("rope.scaling.original_context_length", context)),
            "beta_fast": float(m.get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(m.get("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}


# what every gpt-oss block holds besides q/k/v/o weights and norms: HF's model has these parameters always
_OSS_REQUIRED = ("attn_sinks.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias", "ffn_gate_exps.weight",
                 "ffn_gate_exps.bias", "ffn_up_exps.weight", "ffn_up_exps.bias", "ffn_down_exps.weight",
                 "ffn_down_exps.bias")


def _gpt_oss(m: _Metadata) -> dict:
    cfg = _common(m)
    head_dim = cfg["head_dim"]
    _full_rope(m, head_dim)  # llama.cpp: n_rot = head_dim, attention scale n_rot^-1/2
    experts_ff = int(m.get("expert_feed_forward_length"))
    if cfg["intermediate_size"] != experts_ff:  # the converter writes intermediate_size to both
        m.refuse("feed_forward_length", f"gpt-oss has no dense feed-forward; the experts' width is {experts_ff}")
    window = int(m.get("attention.sliding_window"))
    if window <= 0:
        m.refuse("attention.sliding_window", "gpt-oss's sliding layers need a window")
    n = cfg["num_hidden_layers"]
    for i in range(n):
        for part in _OSS_REQUIRED:
            if f"blk.{i}.{part}" not in m.tensors:
                raise ValueError(f"GGUF file {m.path}: gpt-oss tensor 'blk.{i}.{part}' is missing")
    cfg.update(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_act="silu",
        intermediate_size=experts_ff, num_local_experts=int(m.get("expert_count")),
        num_experts_per_tok=int(m.get("expert_used_count")),
        sliding_window=window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],  # set_swa_pattern(2)
        rope_parameters=_yarn_or_plain_rope(m, cfg["max_position_embeddings"]),
        swiglu_alpha=1.702, swiglu_limit=7.0,  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants
        attention_bias=m.layer_has("attn_q.bias"),
    )
    return cfg


_GEMMA_LAYER = {**_ATTN, **_MLP, **_GEMMA_NORMS}
_GLM_LAYER = {
    **_ATTN, **_QK_NORM, **_MLP, "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate.e_score_correction",  # + '.bias': the HF buffer name
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}

_OSS_LAYER = {
    **_ATTN, "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
    # [E, I, H] / [E, H, I] stacks and [E, I] / [E, H] biases: GptOssForCausalLM takes these llama.cpp layouts
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}

ARCHS: dict[str, GgufArch] = {
    "gemma2": GgufArch(_gemma2, _GEMMA_LAYER, norm_plus_one=True, tied_only=True),
    "gemma3": GgufArch(_gemma3, {**_GEMMA_LAYER, **_QK_NORM}, norm_plus_one=True),
    "phi3": GgufArch(_phi3, {**_ATTN, "attn_qkv": "self_attn.qkv_proj", **_PRE_NORMS,
                             "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
                     config_tensors=("rope_factors_long.weight", "rope_factors_short.weight")),
    "olmo2": GgufArch(_olmo2, {**_ATTN, **_QK_NORM, **_MLP, "post_attention_norm": "post_attention_layernorm",
                               "post_ffw_norm": "post_feedforward_layernorm"}),
    "granite": GgufArch(_granite, {**_ATTN, **_MLP, **_PRE_NORMS}, permute_qk=True),
    "smollm3": GgufArch(_smollm3, {**_ATTN, **_MLP, **_PRE_NORMS}, permute_qk=True),
    "glm4moe": GgufArch(_glm4moe, _GLM_LAYER, mtp_blocks=True),
    "gpt-oss": GgufArch(_gpt_oss, _OSS_LAYER, leafless=("attn_sinks",)),
}


# ---- reading a file -----------------------------------------------------------------------------------

def file_architecture(path: str) -> str:
    """general.architecture of a GGUF file (its header and tensor table only: gguf_file.GgufTensors)."""
    from roofline.model_executor.loader.gguf_file import GgufTensors

    return GgufTensors(path).architecture


def hf_config_dict(path: str) -> dict:
    """The transformers config (as a dict: model_type, architectures and the fields) of a GGUF file of one
    of ARCHS; a metadata key or a tensor it cannot honour is a ValueError naming it."""
    import gguf

    reader = gguf.GGUFReader(path)
    metadata = {key: f.contents() for key, f in reader.fields.items()
                if not key.startswith(("GGUF.", "tokenizer.ggml."))}  # the vocabulary: tokenizer()'s
    metadata.update({key: reader.fields[key].contents() for key in _TOKEN_IDS if key in reader.fields})
    arch = metadata["general.architecture"]
    spec = ARCHS[arch]
    tensors = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}  # ggml: fastest first
    m = _Metadata(arch, metadata, tensors, path)
    m.tensor_values = {t.name: [float(v) for v in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]
                       for t in reader.tensors if t.name in spec.config_tensors}
    for key in metadata:
        prefix = key.split(".", 1)[0]
        if prefix not in ("general", "tokenizer", "quantize", "split", arch):  # quantize.*: imatrix provenance
            raise ValueError(f"GGUF metadata {key!r}: not a key of a {arch} file that roofline can honour")
    if int(metadata.get("split.count", 1)) != 1:
        raise ValueError(f"GGUF metadata 'split.count' = {metadata['split.count']}: split GGUF files are not "
                         "supported (merge them with llama-gguf-split --merge)")
    cfg = spec.config(m)
    unread = m.unread()
    if unread:
        raise ValueError(f"GGUF metadata {unread[0]!r} = {metadata[unread[0]]!r} is not honoured by roofline's "
                         f"{arch} mapping" + (f" (nor {', '.join(map(repr, unread[1:]))})" if unread[1:] else ""))
    skip_from = cfg["num_hidden_layers"]
    for name in tensors:
        if name in spec.config_tensors:
            continue
        try:
            _layer_name(spec, name, skip_from)
        except KeyError:
            raise ValueError(f"GGUF tensor {name!r} has no counterpart in roofline's {arch} mapping") from None
    return cfg


def hf_config(path: str):
    """hf_config_dict as a transformers config object."""
    from transformers import AutoConfig

    cfg = dict(hf_config_dict(path))
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def tokenizer(path: str):
    """The tokenizer the file's tokenizer.* metadata describes (transformers' GGUF tokenizer builder),
    or None when the file has none."""
    import os

    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import read_gguf_metadata

    if "tokenizer.ggml.model" not in read_gguf_metadata(path)[0]:
        return None
    return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                   gguf_file=os.path.basename(path))


# ---- tensors ------------------------------------------------------------------------------------------

def _layer_name(spec: GgufArch, name: str, skip_from: int) -> Optional[str]:
    """The HF name of GGUF tensor `name` (None: skipped); KeyError when the mapping has none."""
    if name in _GLOBAL:
        if name == "output.weight" and spec.tied_only:
            raise KeyError(name)
        return _GLOBAL[name]
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(name)
    layer, part, leaf = int(m[1]), m[2], m[3]
    if layer >= skip_from:
        if spec.mtp_blocks:
            return None  # a GLM-4.5 MTP block (blk.<num_hidden_layers + i>): not served
        raise KeyError(name)
    if part not in spec.layer_tensors:
        raise KeyError(name)
    hf = spec.layer_tensors[part]
    if part == "exp_probs_b":  # blk.<i>.exp_probs_b.bias: the router's e_score_correction_bias
        if leaf != "bias":
            raise KeyError(name)
        return f"model.layers.{layer}.{hf}_bias"
    if part in spec.leafless:  # gpt-oss's blk.<i>.attn_sinks.weight: the parameter self_attn.sinks
        if leaf != "weight":
            raise KeyError(name)
        return f"model.layers.{layer}.{hf}"
    return f"model.layers.{layer}.{hf}.{leaf}"


def tensor_name(arch: str, name: str, hf_config) -> Optional[str]:
    """The HF parameter name of GGUF tensor `name` in a file of `arch` (one of ARCHS); None for a tensor
    that is no parameter (consumed by the config, or an MTP block).  Unknown names raise ValueError
    (hf_config_dict has refused such a file already)."""
    spec = ARCHS[arch]
    if name in spec.config_tensors:
        return None
    try:
        return _layer_name(spec, name, int(hf_config.num_hidden_layers))
    except KeyError:
        raise ValueError(f"GGUF tensor {name!r} has no counterpart in roofline's {arch} mapping") from None


def adjust(arch: str, hf_name: str, tensor):
    """A dense tensor as the HF checkpoint holds it: Gemma's 1 + w norms back to w."""
    if ARCHS[arch].norm_plus_one and hf_name.endswith("norm.weight"):
        return tensor - 1.0
    return tensor
