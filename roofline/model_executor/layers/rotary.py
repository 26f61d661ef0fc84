"""Rotary position embedding (rotate-half form) with the rope-scaling variants of the Llama family and
Phi-3's LongRoPE.  YaRN follows HF's `_compute_yarn_parameters`, `truncate` included (gpt-oss sets it
false: the correction range's bounds are not rounded to whole dimensions).

cos/sin are precomputed for every position up to max_position; a batch indexes them by its flat
positions tensor, so no per-request work happens here.  A rope type not listed in SUPPORTED_ROPE_TYPES
is a start-up error naming the field (`rope_parameters['rope_type']`, `rope_scaling.type` in older configs).

LongRoPE (`longrope`: Phi-3 / Phi-3.5 / Phi-4): inv_freq = 1 / (ext * theta^(2i/d)) with ext the
per-frequency `short_factor` or `long_factor`, and cos/sin scaled by the attention factor (mscale):
`attention_factor` if given, else sqrt(1 + ln(s) / ln(original_max_position_embeddings)) for
s = `factor` or max_position_embeddings / original_max_position_embeddings (1 for s <= 1), as HF.
HF transformers picks the factors per forward call: `long_factor` once the sequence is longer than
original_max_position_embeddings, `short_factor` before, and its Phi-3 generate() drops the KV cache
and re-encodes the whole sequence when it crosses that length.  A paged engine cannot follow that
switch: K/V already in the cache (and prefix-cache blocks shared by requests of different lengths) keep
the rotation they were written with, and a batch mixes short and long requests.  So the factors are
chosen once, from the config: `long_factor` iff max_position_embeddings > original_max_position_embeddings
(the model is configured for contexts past its pretraining window; vLLM's choice too), else
`short_factor`.  This equals HF exactly for a model whose max_position_embeddings is within the original
window, and for every sequence longer than that window otherwise; a shorter sequence on a long-context
model gets the long factors where HF would use the short ones.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
from torch import nn

from roofline.model_executor.layers import fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


def rope_parameters(hf_config) -> dict:
    """rope_theta and scaling from either the transformers-5 `rope_parameters` or older fields."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if params["rope_type"] == "longrope" and getattr(hf_config, "original_max_position_embeddings", None):
        # Phi-3 keeps the pretraining window at the top level; HF gives it priority over the rope dict's
        params["original_max_position_embeddings"] = hf_config.original_max_position_embeddings
    return params


def _longrope(params: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE's inv_freq [dim/2] and attention factor, the factors chosen from the config (module doc)."""
    def field(key):
        if params.get(key) is None:
            raise ValueError(f"rope_parameters['{key}'] is required for rope_type 'longrope'")
        return params[key]

    original = int(field("original_max_position_embeddings"))
    use_long = max_position > original
    key = "long_factor" if use_long else "short_factor"
    ext = field(key)
    field("short_factor" if use_long else "long_factor")  # both belong to a longrope config
    if len(ext) != dim // 2:
        raise ValueError(f"rope_parameters['{key}'] has {len(ext)} entries; the rotary dimension {dim} needs "
                         f"{dim // 2}")
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * float(params["rope_theta"]) ** exponent)
    return inv_freq, float(attention_factor)


def _inv_freq(params: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params["rope_type"]
    attention_factor = 1.0
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low = float(params.get("low_freq_factor", 1.0))
        high = float(params.get("high_freq_factor", 4.0))
        old_len = float(params.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type == "yarn":
        original = params.get("original_max_position_embeddings")
        factor = params.get("factor")
        if factor is None:  # HF: the ratio of the context length to the pretraining window
            if original is None:
                raise ValueError("rope_parameters['factor'] is required for rope_type 'yarn' (or "
                                 "original_max_position_embeddings to derive it from)")
            factor = max_position / float(original)
        factor = float(factor)
        old_len = float(original if original is not None else max_position / factor)
        beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
        truncate = params.get("truncate", True)  # gpt-oss: False (the correction range's bounds kept fractional)
        mscale = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if params.get("attention_factor") is not None:
            attention_factor = float(params["attention_factor"])
        elif mscale[0] and mscale[1]:
            attention_factor = get_mscale(factor, mscale[0]) / get_mscale(factor, mscale[1])
        else:
            attention_factor = get_mscale(factor)

        def correction_dim(rot):
            return (dim * math.log(old_len / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    elif rope_type == "longrope":
        inv_freq, attention_factor = _longrope(params, dim, max_position)
    elif rope_type == "dynamic":
        # Dynamic NTK scaling changes with sequence length; for lengths within the original window
        # it equals the default rope, which is what we support (max_model_len is capped there).
        pass
    else:
        raise ValueError(f"unsupported rope_parameters['rope_type'] (rope_scaling.type) {rope_type!r}; "
                         f"supported: {SUPPORTED_ROPE_TYPES}")
    return inv_freq, attention_factor


# (rope parameters, rotary dim, positions, device) -> the (cos, sin) tables layers with those share: a model's
# layers hold one copy, not one each (a 32-layer model at 128k positions: 4 GiB of fp32 tables otherwise)
_TABLES: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()


def _tables(params: dict, rotary_dim: int, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (repr(sorted(params.items(), key=lambda kv: kv[0])), rotary_dim, max_position,
           str(torch.get_default_device()) if hasattr(torch, "get_default_device") else "")
    cos, sin = _TABLES.get(key + ("cos",)), _TABLES.get(key + ("sin",))
    if cos is None or sin is None:
        inv_freq, attention_factor = _inv_freq(params, rotary_dim, max_position)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [P, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
        _TABLES[key + ("cos",)], _TABLES[key + ("sin",)] = cos, sin
    return cos, sin


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict, rotary_dim: Optional[int] = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        cos, sin = _tables(params, self.rotary_dim, max_position)  # shared with the model's other layers
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 1, rot] tables for a batch; computed once per step and shared by every layer."""
        return (self.cos_cache[positions].unsqueeze(1).to(dtype), self.sin_cache[positions].unsqueeze(1).to(dtype))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin=None):
        """q [N, H, D], k [N, H_kv, D] rotated at their positions [N]."""
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, q.dtype)
        if fused_ops.active(q) and fused_ops.can_rope(q, k, cos):
            return fused_ops.rotary_embedding(q, k, cos, sin)  # one fused kernel, rotates q, k in place
        r = self.rotary_dim
        if r == self.head_dim:
            return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
        q_rot, q_pass = q[..., :r], q[..., r:]
        k_rot, k_pass = k[..., :r], k[..., r:]
        q = torch.cat((q_rot * cos + self._rotate_half(q_rot) * sin, q_pass), dim=-1)
        k = torch.cat((k_rot * cos + self._rotate_half(k_rot) * sin, k_pass), dim=-1)
        return q, k
