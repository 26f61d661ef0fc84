"""HF-parity helpers: tiny random HF models saved as real checkpoints, and HF greedy references."""

from __future__ import annotations

import os
from typing import Optional

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=384, max_position_embeddings=512, rms_norm_eps=1e-6,
            initializer_range=0.25, tie_word_embeddings=False)


# mixtures of experts: 8 experts of width 32 (Mixtral: intermediate_size), top-2 or top-3
TINY_MOE = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    # sparse layers: (i + 1) % 2 == 0 and not in mlp_only_layers -> 1 and 5; 0, 2, 3, 4 dense (width 96)
    "qwen2_moe": dict(num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[3],
                      intermediate_size=96, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                      head_dim=16),
}


# Phi-3 LongRoPE: sequences longer than this take the long factors in HF (and always here: 512 > 16)
PHI3_ORIGINAL_MAX_POSITIONS = 16


def phi3_longrope(**overrides) -> dict:
    """A fresh LongRoPE dict for the tiny Phi-3 (rotary dim 12: head 16 x 0.75, so 6 factors each)."""
    return dict(dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.05, 1.1, 1.2, 1.3, 1.5],
                     long_factor=[1.0, 1.5, 2.5, 4.0, 7.0, 12.0]), **overrides)


def tiny_config(arch: str, **overrides):
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    if arch in TINY_MOE:
        kw = dict(TINY, **dict(TINY_MOE[arch], **overrides))
        return {"mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig}[arch](**kw)
    kw = dict(TINY, **overrides)
    if arch == "llama":
        cfg = LlamaConfig(**kw)
    elif arch == "qwen2":
        cfg = Qwen2Config(**kw)
    elif arch == "qwen3":
        kw.setdefault("head_dim", 16)
        cfg = Qwen3Config(**kw)
    elif arch == "smollm3":  # 4 layers, the 4th without rope (no_rope_layer_interval 4)
        from transformers import SmolLM3Config

        kw["num_hidden_layers"] = max(kw["num_hidden_layers"], 4)
        kw = dict(dict(pad_token_id=None, bos_token_id=1, eos_token_id=2), **kw)  # the defaults exceed the vocabulary
        cfg = SmolLM3Config(**kw)
    elif arch == "granite":  # multipliers away from 1 so each matters
        from transformers import GraniteConfig

        kw = dict(dict(embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5,
                       logits_scaling=4.0), **kw)
        cfg = GraniteConfig(**kw)
    elif arch == "glm4_moe":  # GLM-4.5: 3 layers, the first dense; grouped sigmoid routing, partial rope, q/k norm
        from transformers import Glm4MoeConfig

        glm = dict(num_hidden_layers=3, head_dim=32, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                   norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5)
        kw = dict(TINY, **dict(glm, **overrides))
        cfg = Glm4MoeConfig(**kw)
    elif arch == "phi3":  # LongRoPE past a 16-token pretraining window (attention factor 1.5), partial rope
        from transformers import Phi3Config

        phi3 = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2, sliding_window=None,
                    original_max_position_embeddings=PHI3_ORIGINAL_MAX_POSITIONS, partial_rotary_factor=0.75,
                    rope_parameters=phi3_longrope())
        cfg = Phi3Config(**dict(phi3, **kw))
    elif arch in ("gemma2", "gemma3"):  # windows of 6 keys (shorter than the prompts), soft-caps that bend
        from transformers import Gemma2Config, Gemma3TextConfig

        gemma = dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if arch == "gemma2":
            gemma.update(attn_logit_softcapping=4.0, final_logit_softcapping=3.0)
            cls = Gemma2Config
        else:  # three local layers, then a global one with its own base and linear scaling
            gemma.update(layer_types=["sliding_attention"] * 3 + ["full_attention"],
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                             "rope_theta": 1000000.0}})
            cls = Gemma3TextConfig
        kw = dict(TINY, **dict(gemma, **overrides))
        cfg = cls(**kw)
    elif arch == "gpt_oss":  # 4 layers alternating 6-key windows and full attention, 4 experts top-2, sinks, YaRN
        from transformers import GptOssConfig

        oss = dict(num_hidden_layers=4, head_dim=16, sliding_window=6, num_local_experts=4, num_experts_per_tok=2,
                   intermediate_size=32, swiglu_limit=1.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                   rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0,
                                        beta_slow=1.0, truncate=False, original_max_position_embeddings=64))
        cfg = GptOssConfig(**dict(TINY, **dict(oss, **overrides)))
    elif arch == "qwen3_next":  # 3 Gated DeltaNet layers, then full attention; 4 experts top-2 + shared, layer 1 dense
        from transformers import Qwen3NextConfig

        nxt = dict(num_hidden_layers=4, head_dim=16, intermediate_size=96,
                   layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1],
                   norm_topk_prob=True, partial_rotary_factor=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cfg = Qwen3NextConfig(**dict(TINY, **dict(nxt, **overrides)))
    elif arch == "olmo2":
        from transformers import Olmo2Config

        kw = dict(dict(pad_token_id=None, bos_token_id=None, eos_token_id=2), **kw)  # the defaults exceed the vocabulary
        cfg = Olmo2Config(**kw)
    else:
        raise ValueError(arch)
    return cfg


def build_tiny_model(arch: str, path: str, seed: int = 0, **overrides):
    """Random HF model saved to `path` (config.json + model.safetensors); returns the HF model (fp32)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # visible biases / norm weights so every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".sinks"):  # gpt-oss's attention sinks: logits as large as the scores'
                p.copy_(torch.randn_like(p) * 2.0)
        for name, b in model.named_buffers():  # DeepSeek-V3-style routers (GLM-4.5): steer the choice
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    model.eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


def parity_devices() -> list[str]:
    """The devices the parity tests run on: the CPU always, CUDA where this machine has a GPU."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


_on_device: dict[tuple[int, str], torch.nn.Module] = {}


def hf_on(model, device: str):
    """The HF reference on `device` (a copy, made once per model and device; the CPU model is itself)."""
    if device == "cpu":
        return model
    key = (id(model), device)
    if key not in _on_device:
        import copy

        _on_device[key] = copy.deepcopy(model).to(device)
    return _on_device[key]


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: Optional[int] = None) -> list[int]:
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos_token_id, pad_token_id=0, min_new_tokens=0 if eos_token_id else max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


@torch.no_grad()
def hf_greedy_given(model, prompt_ids: list[int], tokens: list[int]) -> list[int]:
    """HF's greedy choice at each of `tokens`' positions given the prompt and the tokens before it: one
    forward pass over prompt + tokens[:-1] (teacher forcing).  `tokens` is HF's greedy continuation
    exactly when this returns `tokens` again: HF's first choice after the prompt is tokens[0], its choice
    after prompt + tokens[:1] is tokens[1], and so on, which is what generate(do_sample=False) computes
    one step at a time.  On the 135M default model this costs one forward pass of the whole sequence
    instead of one per new token (40 tokens: about 0.2 s against 2.5 s through generate())."""
    logits = model(torch.tensor([prompt_ids + tokens[:-1]], device=model.device)).logits[0]
    return logits[len(prompt_ids) - 1 :].argmax(-1).tolist()


@torch.no_grad()
def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of the next-token logits at every position of token_ids: [L x V]."""
    logits = model(torch.tensor([token_ids], device=model.device)).logits[0].float()
    return logits.log_softmax(-1).cpu()


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
