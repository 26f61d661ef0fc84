"""OpenAI gpt-oss (GptOssForCausalLM: gpt-oss-20b / 120b), as HF transformers computes it
(transformers/models/gpt_oss).

The layer is Llama's pre-norm layer (llama.py) with:
  attention   q/k/v/o biases (`attention_bias`); YaRN rope (rotary.py, `truncate` false as gpt-oss sets it) in
              the half-split layout; `layer_types` alternating "sliding_attention" (a query sees its last
              `sliding_window` keys) and "full_attention"; one learned sink logit per query head
              (`self_attn.sinks` [H], this rank's heads under tensor parallelism) joining each softmax's
              denominator -- the window and the sinks go to the attention backend as AttentionOptions
  feed-forward a mixture of `num_local_experts` experts: the router is a linear layer with a bias, top-k of
              its logits then a softmax over those k (router.py "topk_softmax"); each expert is
              down(act(x W_gu + b_gu)) + b_d with act gpt-oss's clamped SwiGLU (gate clamped above at
              `swiglu_limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(`swiglu_alpha` * gate)) --
              FusedMoE with that activation and biases (torch_experts.ExpertActivation); tensor parallel
              (each expert's width split, one all-reduce) and expert parallel (whole experts per rank, EPLB)

Checkpoint: the experts are stacked as HF keeps them, gate_up_proj [E, H, 2I] whose even columns are the gate
and odd ones the up projection, gate_up_proj_bias [E, 2I] (interleaved alike), down_proj [E, I, H],
down_proj_bias [E, H]; `_load_expert` de-interleaves and transposes them into FusedMoE's [gate; up] rows.
OpenAI's release stores gate_up_proj / down_proj in MXFP4 (`*_blocks` + `*_scales`, quantization_config
quant_method "mxfp4"): quantization/mxfp4.py's reader turns them into these same tensors at load, with HF's
values.  A llama.cpp GGUF file (loader/gguf_archs.py) holds the experts one projection a stack, as
<module>.{gate_proj|up_proj}.weight [E, I, H] / .bias [E, I] and down_proj.weight [E, H, I] / .bias [E, H]
(HF's even gate_up rows and entries are gate_proj's, the odd ones up_proj's); `_load_gguf_expert` takes
those.  The fp32 CPU layer stack (llama_cpu_stack.py) steps aside (experts, sinks, windows).
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from roofline.attention.backend import AttentionBackend, AttentionOptions
from roofline.model_executor.layers.linear import ReplicatedLinear
from roofline.model_executor.layers.moe import FusedMoE
from roofline.model_executor.layers.moe.router import num_routed_experts, routing_from_hf_config
from roofline.model_executor.layers.moe.torch_experts import ExpertActivation
from roofline.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, load_named_tensor
from roofline.model_executor.models.llama_moe import LlamaMoeForCausalLM

_EXPERT_TENSOR = re.compile(r"^(?P<module>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<suffix>_bias)?$")
_GGUF_EXPERT_TENSOR = re.compile(r"^(?P<module>.+\.mlp\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)"
                                 r"\.(?P<leaf>weight|bias)$")
_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class GptOssAttention(LlamaAttention):
    """Llama attention with q/k/v/o biases and a learned sink logit per query head (fp32, this rank's heads)."""

    def __init__(self, config, layer_idx: int, backend: AttentionBackend, qk_norm: bool, bias: bool, o_bias: bool):
        super().__init__(config, layer_idx, backend, qk_norm=False, bias=bias, o_bias=o_bias)
        self.tp_rank = self.qkv_proj.tp_rank
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        # the options hold the parameter itself: loading fills it in place
        self.attn_options = AttentionOptions(sliding_window=self.attn_options.sliding_window, sinks=self.sinks)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """self_attn.sinks [H]: this rank's query heads (QKVParallelLinear's split)."""
        total = self.num_heads * self.qkv_proj.tp_size
        if tuple(loaded.shape) != (total,):
            raise ValueError(f"attention sinks: checkpoint shape {tuple(loaded.shape)}, expected ({total},)")
        param.data.copy_(loaded.narrow(0, self.tp_rank * self.num_heads, self.num_heads).to(param.dtype))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention


class GptOssMoE(nn.Module):
    """router (linear with a bias) -> FusedMoE (clamped SwiGLU experts with biases); the all-reduce inside."""

    def __init__(self, config):
        super().__init__()
        num_experts = num_routed_experts(config)
        self.router = ReplicatedLinear(config.hidden_size, num_experts, bias=True)
        activation = ExpertActivation("clamped_swiglu", alpha=float(config.swiglu_alpha),
                                      limit=float(config.swiglu_limit))
        self.experts = FusedMoE(num_experts, config.hidden_size, config.intermediate_size,
                                routing_from_hf_config(config), width_field="intermediate_size",
                                activation=activation, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssForCausalLM(LlamaMoeForCausalLM):
    decoder_layer_cls = GptOssDecoderLayer
    qkv_bias_default = True  # attention_bias: q/k/v and o

    def __init__(self, config, backend: AttentionBackend):
        if not getattr(config, "layer_types", None):
            raise ValueError("a gpt-oss config needs layer_types (sliding_attention / full_attention per layer)")
        limit = getattr(config, "swiglu_limit", None)
        if limit is None or not float(limit) > 0:
            raise ValueError(f"swiglu_limit must be positive, got {limit!r}")
        if getattr(config, "swiglu_alpha", None) is None:
            raise ValueError("swiglu_alpha is missing from the gpt-oss config")
        super().__init__(config, backend)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return GptOssMoE(config)

    def _load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> Optional[str]:
        if name.endswith(("_blocks", "_scales")):
            raise ValueError(f"checkpoint tensor {name!r} holds MXFP4 blocks / scales but config.json has no "
                             "quantization_config with quant_method 'mxfp4'")
        m = _EXPERT_TENSOR.match(name)
        if m is not None:
            return self._load_expert(name, m, tensor)
        m = _GGUF_EXPERT_TENSOR.match(name)
        if m is not None:
            return self._load_gguf_expert(name, m, tensor)
        return load_named_tensor(self, name, tensor, params, self.stacked_params)

    def _moe(self, name: str, m: re.Match) -> FusedMoE:
        try:
            moe = self.get_submodule(m["module"])
        except AttributeError:
            moe = None
        if not isinstance(moe, FusedMoE):
            raise ValueError(f"checkpoint tensor {name!r} has no mixture-of-experts layer at {m['module']!r}")
        return moe

    def _load_gguf_expert(self, name: str, m: re.Match, tensor: torch.Tensor) -> str:
        """One of llama.cpp's per-projection expert stacks (module doc) into the FusedMoE at <module>."""
        moe = self._moe(name, m)
        shard, bias = _SHARD[m["proj"]], m["leaf"] == "bias"
        if not bias:
            try:
                moe.load_stacked(m["proj"], tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
            return f"{m['module']}.{'w2' if shard == 'w2' else 'w13'}_weight"
        want = (moe.num_experts, moe.hidden_size if shard == "w2" else moe.intermediate_size)
        if tuple(tensor.shape) != want:
            raise ValueError(f"checkpoint tensor {name!r} has shape {list(tensor.shape)}, expected {list(want)}")
        for e in range(moe.num_experts):
            moe.bias_loader(tensor[e], shard, e)
        return f"{m['module']}.{'w2' if shard == 'w2' else 'w13'}_bias"

    def _load_expert(self, name: str, m: re.Match, tensor: torch.Tensor) -> str:
        """One of HF's stacked expert tensors (module doc) into the FusedMoE at <module>."""
        moe = self._moe(name, m)
        e_, h, i = moe.num_experts, moe.hidden_size, moe.intermediate_size
        gate_up, bias = m["proj"] == "gate_up_proj", m["suffix"] is not None
        want = {(True, False): (e_, h, 2 * i), (False, False): (e_, i, h), (True, True): (e_, 2 * i),
                (False, True): (e_, h)}[(gate_up, bias)]
        if tuple(tensor.shape) != want:
            raise ValueError(f"checkpoint tensor {name!r} has shape {list(tensor.shape)}, expected {list(want)}")
        for e in range(e_):
            t = tensor[e]
            if bias:
                if gate_up:  # even entries gate, odd up
                    moe.bias_loader(t[0::2], "w1", e)
                    moe.bias_loader(t[1::2], "w3", e)
                else:
                    moe.bias_loader(t, "w2", e)
            elif gate_up:  # [H, 2I]: even columns gate, odd up -> [I, H] each
                moe.weight_loader(moe.w13_weight, t[:, 0::2].t(), "w1", e)
                moe.weight_loader(moe.w13_weight, t[:, 1::2].t(), "w3", e)
            else:  # [I, H] -> [H, I]
                moe.weight_loader(moe.w2_weight, t.t(), "w2", e)
        param = ("w13" if gate_up else "w2") + ("_bias" if bias else "_weight")
        return f"{m['module']}.{param}"
