"""DeepSeek-V2 / V3 (MLA + DeepSeekMoE) against HF transformers on tiny random checkpoints written by
`save_pretrained`: greedy tokens identical in fp32 on CPU under the default engine, a 16-token budget
(chunked prefill), a pool small enough to preempt (recompute and swap) and tensor_parallel_size=2, with
prompts sharing a prefix (prefix-cache hits); every block back in the pool.  Also: logprobs within 1e-3,
the latent's KV bytes per token, the pool's capacity equal to the planner's, and bad configs failing
at load with the field named."""

from __future__ import annotations

import json
import os

import pytest
import torch

from roofline import LLM, SamplingParams
from tests.attention.test_kv_spec import planned_tokens
from tests.engine.test_feature_invariance import shared_prefix_prompts
from tests.reference.hf_models import hf_greedy, hf_logprobs

TINY_DS = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=384, max_position_embeddings=512, rms_norm_eps=1e-6,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
               initializer_range=0.25, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.707,
        "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
CHECKPOINTS = {
    # no q_lora_rank, greedy top-k, DeepSeek's yarn rope with mscale
    "v2": ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy", rope_parameters=YARN)),
    # q_lora_rank, group_limited_greedy, routed_scaling_factor
    "v2_qlora": ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                     routed_scaling_factor=1.5)),
    # sigmoid + correction bias, grouped top-2-sum, renormalised, scaled
    "v3": ("deepseek_v3", dict(q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                               norm_topk_prob=True)),
}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def ds_config(model_type: str, **overrides):
    from transformers import DeepseekV2Config, DeepseekV3Config, DeepseekV32Config

    cls = {"deepseek_v2": DeepseekV2Config, "deepseek_v3": DeepseekV3Config, "deepseek_v32": DeepseekV32Config}[model_type]
    return cls(**dict(TINY_DS, **overrides))


def build_deepseek(model_type: str, path: str, seed: int = 0, **overrides):
    """A random HF DeepSeek saved to `path`; norms and the correction bias perturbed so they matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(ds_config(model_type, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """name -> (checkpoint, prompts sharing a prefix, HF greedy outputs, HF model), built on first use."""
    made = {}

    def get(name):
        if name not in made:
            model_type, overrides = CHECKPOINTS[name]
            path = str(tmp_path_factory.mktemp(f"tiny-{name}"))
            hf = build_deepseek(model_type, path, seed=2, **overrides)
            prompts = shared_prefix_prompts(hf.config.vocab_size, n=4, seed=4)
            made[name] = (path, prompts, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts], hf)
        return made[name]

    return get


def run(path, prompts, sampling=GREEDY, **engine_args):
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # every block back in the pool
    return outs, stats, llm


VARIANTS = {
    "default": dict(num_kv_blocks=128),
    "budget_16": dict(num_kv_blocks=128, max_num_batched_tokens=16),
    "preempt_recompute": dict(num_kv_blocks=12, block_size=8, preemption_mode="recompute"),
    "preempt_swap": dict(num_kv_blocks=12, block_size=8, preemption_mode="swap", swap_space=0.01),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_matches_hf(deepseek, name, variant):
    path, prompts, reference, _ = deepseek(name)
    outs, stats, llm = run(path, prompts, **VARIANTS[variant])
    assert [o.outputs[0].token_ids for o in outs] == reference
    if variant == "default":
        assert stats.prefix_cache_hits > 0
        attn = llm.llm_engine.executor.worker.model.model.layers[0].self_attn
        from roofline.cpu import ops as cpu_ops

        assert attn.backend.name == ("cpu" if cpu_ops.available() else "torch")  # the native decode kernel
    if variant.startswith("preempt"):
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tensor_parallel_2_matches_hf(deepseek, name):
    """Heads split over two ranks, the latent cache replicated on both."""
    path, prompts, reference, hf = deepseek(name)
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        cfg = hf.config  # each rank holds the whole latent: a block's bytes are tp=1's
        latent_block = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 * cfg.num_hidden_layers * 16
        assert llm.llm_engine.executor.block_bytes() == latent_block
    finally:
        llm.llm_engine.shutdown()


def test_logprobs_within_1e3_of_hf(deepseek):
    path, prompts, _, hf = deepseek("v3")
    outs, _, _ = run(path, prompts[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
                     num_kv_blocks=64, max_num_batched_tokens=16)
    for p, out in zip(prompts, outs):
        ids = out.outputs[0].token_ids
        ref = hf_logprobs(hf, p + ids[:-1])[len(p) - 1:]
        for pos, lp in enumerate(out.outputs[0].logprobs):
            for tid, entry in lp.items():
                assert abs(entry.logprob - ref[pos, tid].item()) < 1e-3


def test_kv_bytes_per_token_is_the_latent(deepseek):
    """(kv_lora_rank + qk_rope_head_dim) x dtype bytes x layers, and the planner's capacity for MLA."""
    path, _, _, hf = deepseek("v3")
    cfg = hf.config
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 * cfg.num_hidden_layers
    budget, bs = 2 * 2**20 + 777, 16
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_memory=budget, block_size=bs, show_progress=False)
    assert llm.llm_engine.executor.block_bytes() == per_token * bs
    tokens = llm.llm_engine.get_stats().num_total_blocks * bs
    assert tokens == budget // (per_token * bs) * bs
    assert tokens == planned_tokens(json.loads(open(os.path.join(path, "config.json")).read()), budget, bs)


@pytest.mark.parametrize("field,value,match", [
    ("topk_method", "random_walk", "topk_method"),
    ("scoring_func", "tanh", "scoring_func"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_bad_config_fails_at_load_naming_the_field(tmp_path, field, value, match):
    cfg = ds_config("deepseek_v2", q_lora_rank=None).to_dict()
    cfg["architectures"] = ["DeepseekV2ForCausalLM"]
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=8, show_progress=False)


def test_tp_size_not_dividing_the_heads_fails_naming_the_field(monkeypatch):
    from roofline.attention.selector import get_attention_backend
    from roofline.model_executor.models import deepseek

    monkeypatch.setattr(deepseek, "get_tp_size", lambda: 3)
    with pytest.raises(ValueError, match="num_attention_heads"):
        deepseek.DeepseekMLA(ds_config("deepseek_v3"), get_attention_backend("torch", "cpu"))


def test_missing_expert_tensor_fails_naming_it(deepseek, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _, _, _ = deepseek("v2_qlora")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj"):
        LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=8, show_progress=False)


def test_rope_on_pairs_matches_hf_v3_and_v2():
    """V3's interleaved rope bit for bit; V2's complex-number rope up to the output layout (pairs
    interleaved there, halves here), which q and k share, so every q.k product is the same."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    from roofline.model_executor.layers.rotary import RotaryEmbedding
    from roofline.model_executor.models.deepseek import rope_on_pairs

    g = torch.Generator().manual_seed(0)
    n, h, r = 5, 3, 16
    q, k = torch.randn(n, h, r, generator=g), torch.randn(n, 1, r, generator=g)
    positions = torch.tensor([0, 3, 7, 100, 511])
    rotary = RotaryEmbedding(r, 512, dict(YARN))
    cos, sin = rotary.cos_sin(positions, torch.float32)  # [N, 1, R]
    ours_q, ours_k = rope_on_pairs(q, cos, sin), rope_on_pairs(k, cos, sin)
    hf_q, hf_k = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[:, 0][None],
                                                 sin[:, 0][None])
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1)) and torch.equal(ours_k, hf_k[0].transpose(0, 1))
    # V2: x * freqs_cis * attention_scaling in complex numbers; cos/sin already carry the scaling
    freqs = torch.complex(cos[:, 0, : r // 2], sin[:, 0, : r // 2])
    v2_q, v2_k = apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs[None])
    dots = torch.einsum("nhr,nkr->nhk", ours_q, ours_k)
    torch.testing.assert_close(dots, torch.einsum("hnr,knr->nhk", v2_q[0], v2_k[0]), atol=1e-5, rtol=1e-5)
