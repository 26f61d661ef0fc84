"""W6's accounting (roofline bench throughput --workload w6): the KV tokens 2 GiB holds with MLA and with
ordinary MHA, and the bytes one decoded token reads (only its routed experts)."""

import json

import torch
from transformers import DeepseekV3Config

from roofline.benchmarks.throughput import W6_CONFIG, kv_capacity_2gib, token_read_bytes


def test_w6_kv_capacity_mla_against_mha():
    cfg = DeepseekV3Config(**W6_CONFIG).to_dict()
    mla_per_token = (256 + 32) * 4 * 8  # (kv_lora_rank + rope) x fp32 x layers
    mha_per_token = 2 * 16 * (64 + 32) * 4 * 8  # K and V of 16 heads of qk_nope + rope
    engine_tokens = (2 << 30) // (mla_per_token * 16) * 16
    kv = kv_capacity_2gib(cfg, engine_tokens, 16)
    assert kv["mla_bytes_per_token"] == mla_per_token and kv["mha_bytes_per_token"] == mha_per_token
    assert kv["mla_planner_tokens"] == engine_tokens
    assert kv["mha_engine_sizing_tokens"] == kv["mha_planner_tokens"] == (2 << 30) // (mha_per_token * 16) * 16


def test_token_read_bytes_counts_only_routed_experts(tmp_path):
    from roofline import LLM

    small = dict(W6_CONFIG, hidden_size=64, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                 n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, num_attention_heads=4,
                 kv_lora_rank=32, q_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                 vocab_size=500)
    cfg = dict(DeepseekV3Config(**small).to_dict(), architectures=["DeepseekV3ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", dtype="float32", num_kv_blocks=4, show_progress=False)
    model = llm.llm_engine.executor.worker.model
    reads = token_read_bytes(model, 100, 4)
    moe = model.model.layers[1].mlp.experts
    expert_bytes = (moe.w13_weight.numel() + moe.w2_weight.numel()) * 4
    assert reads["routed_expert_bytes"] == expert_bytes * 2 / 8
    assert reads["kv_bytes"] == 100 * (32 + 16) * 2 * 4
    total = sum(p.numel() * 4 for p in model.parameters())
    assert reads["always_on_weight_bytes"] == total - model.model.embed_tokens.weight.numel() * 4 - expert_bytes
    assert torch.isfinite(torch.tensor(reads["total"]))


def test_w5_token_bytes_count_the_blocks_and_the_greedy_screen(default_llm):
    """W5's bound: a greedy token of the default model streams its layers' Q4_1 blocks, the norms and the
    LM head's int8 screen (49152 tokens x 576 inputs, an fp32 scale per 32 inputs, two fp32 bounds a token)."""
    from roofline.benchmarks.throughput import token_bytes

    model = default_llm.llm_engine.executor.worker.model
    q4_1 = 30 * 576 * (576 + 192 + 192 + 576 + 3 * 1536) * 20 // 32
    norms = (30 * 2 + 1) * 576 * 4
    screen = 49152 * 576 + 49152 * 18 * 4 + 2 * 49152 * 4
    assert token_bytes(model) == q4_1 + norms + screen


def test_w10_runs_both_modes_on_the_default_architecture(capsys):
    """W10 scaled down (4 requests of at most 16 tokens out, one round): both modes ran W1's requests,
    adapters in a fixed number of bytes (rank 16 A and B of every projection of SmolLM2-135M's 30 layers, fp32)."""
    from roofline.entrypoints.cli import main

    assert main(["bench", "throughput", "--workload", "w10", "--num-requests", "4", "--max-output-tokens", "16",
                 "--json", "--kv-cache-memory", str(64 << 20)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"] == "W10" and out["adapters"] == 4 and out["rank"] == 16
    assert len(out["base_runs_tok_s"]) == len(out["adapter_runs_tok_s"]) == 1
    assert out["base_output_tok_s"] > 0 and out["adapters_output_tok_s"] > 0
    per_layer = 16 * ((576 + 576) + 2 * (576 + 192) + (576 + 576) + 2 * (576 + 1536) + (1536 + 576))
    assert out["bytes_per_adapter"] == 30 * per_layer * 4


def test_max_output_tokens_cuts_the_answers_and_keeps_the_prompts():
    import argparse

    from roofline.benchmarks.throughput import w1_requests

    full = w1_requests(argparse.Namespace(num_requests=8, max_output_tokens=None), 49152)
    cut = w1_requests(argparse.Namespace(num_requests=8, max_output_tokens=40), 49152)
    assert [r.prompt for r in cut] == [r.prompt for r in full]
    assert [r.output_len for r in cut] == [min(r.output_len, 40) for r in full]
    assert max(r.output_len for r in full) > 40  # the cap cut something
