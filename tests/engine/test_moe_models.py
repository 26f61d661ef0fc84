"""Mixture-of-experts models end to end against HF transformers: tiny random Mixtral, Qwen2-MoE (shared
expert, mlp_only_layers, decoder_sparse_step 2) and Qwen3-MoE (norm_topk_prob) checkpoints written by
transformers' save_pretrained, greedy tokens identical to HF's (fp32, CPU) by default, with a token
budget of 16 (chunked prefill), with a pool small enough to preempt (recompute and swap) and under
tensor_parallel_size=2 (one all-reduce per MoE layer, shared expert included); prompts share a prefix
so prefix-cache hits happen, and every KV block is back in the pool after each run."""

from __future__ import annotations

import pytest

from roofline import LLM
from tests.engine.test_feature_invariance import GREEDY, run
from tests.reference.hf_models import TINY_MOE

ARCHS = list(TINY_MOE)


VARIANTS = {
    "default": dict(num_kv_blocks=256),
    "budget_16": dict(num_kv_blocks=256, max_num_batched_tokens=16),
    "preempt_recompute": dict(num_kv_blocks=12, block_size=8, preemption_mode="recompute"),
    "preempt_swap": dict(num_kv_blocks=12, block_size=8, preemption_mode="swap", swap_space=0.01),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_moe_greedy_matches_hf(moe_models, arch, variant):
    path, prompts, reference = moe_models[arch]
    outs, stats = run(path, prompts, **VARIANTS[variant])
    assert outs == reference
    if variant.startswith("preempt"):
        assert stats.num_preemptions > 0
    else:
        assert stats.prefix_cache_hits > 0


def test_moe_models_take_the_cpu_expert_path_not_the_layer_stack(moe_models):
    """On CPU the experts run on the packed native kernels; the dense-only layer stack stays off."""
    from roofline.cpu import ops as cpu_ops
    from roofline.model_executor.layers.moe import FusedMoE

    for arch in ARCHS:
        llm = LLM(moe_models[arch][0], dtype="float32", device="cpu", num_kv_blocks=32, show_progress=False)
        model = llm.llm_engine.executor.worker.model
        assert model.model.cpu_stack is None
        sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(getattr(layer.mlp, "experts", None),
                                                                                FusedMoE)]
        assert sparse == ([1, 5] if arch == "qwen2_moe" else [0, 1])  # qwen2_moe: step 2, layer 3 dense
        moes = [model.model.layers[i].mlp.experts for i in sparse]
        if cpu_ops.available():
            assert all(m.cpu_experts is not None for m in moes)


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_tp2_greedy_matches_hf(moe_models, arch):
    path, prompts, reference = moe_models[arch]
    llm = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2, num_kv_blocks=256, show_progress=False)
    try:
        ex = llm.llm_engine.executor
        ex.reset_collective_counts()
        outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                              use_tqdm=False)]
        assert outs == reference
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.prefix_cache_hits > 0
        # per forward pass: the embedding's all-reduce, then per layer one for attention and ONE for the
        # feed-forward block (a MoE layer's experts and shared expert together); one all-gather of logits
        layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
        for reduces, gathers in ex.collective_counts():
            assert gathers > 0 and reduces == gathers * (1 + 2 * layers), (reduces, gathers)
    finally:
        llm.llm_engine.shutdown()
