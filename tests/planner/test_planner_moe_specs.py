"""The planner's ModelSpec (roofline/planner/model_specs.py) of the MoE models roofline serves: from
the config.json transformers writes, the parameter count equals our model's and HF's (routed experts,
router, Qwen2-MoE's shared expert and its gate), the MoE layer count follows decoder_sparse_step and
mlp_only_layers as our model builds them, and the published Mixtral-8x7B config gives its published
46.7B total / 12.9B active parameters."""

from __future__ import annotations

import pytest
import torch

from roofline.planner.model_specs import ModelSpec, load_model_spec
from tests.reference.hf_models import TINY_MOE, tiny_config


@pytest.mark.parametrize("arch", list(TINY_MOE))
def test_moe_spec_matches_our_model_and_hf(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from roofline.attention.torch_backend import TorchAttentionBackend
    from roofline.model_executor.layers.moe import FusedMoE
    from roofline.model_executor.models.registry import resolve_architecture

    cfg = tiny_config(arch)
    cfg.architectures = [resolve_architecture(cfg)[0]]
    cfg.save_pretrained(tmp_path)
    spec = load_model_spec(str(tmp_path))
    with torch.device("meta"):
        ours = resolve_architecture(cfg)[1](cfg, TorchAttentionBackend())
        hf = AutoModelForCausalLM.from_config(cfg)
    moes = [m for m in ours.modules() if isinstance(m, FusedMoE)]
    assert spec.total_params() == sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert spec.num_moe_layers == len(moes) and spec.num_experts == moes[0].num_experts
    assert spec.num_experts_per_tok == moes[0].routing.top_k
    assert spec.moe_intermediate_size == moes[0].intermediate_size
    assert spec.shared_intermediate_size == (TINY_MOE[arch].get("shared_expert_intermediate_size") or 0)
    assert spec.shared_expert_gate == (arch == "qwen2_moe")


def test_mixtral_8x7b_published_counts():
    spec = ModelSpec.from_hf_config(dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
        tie_word_embeddings=False))
    assert spec.total_params() == pytest.approx(46.7e9, rel=0.002)
    assert spec.active_params() + spec.embedding_params == pytest.approx(12.9e9, rel=0.005)


@pytest.mark.parametrize("tp,dp,redundant", [(2, 1, 0), (2, 2, 0), (2, 2, 4)])
def test_expert_parallel_weights_per_gpu_match_our_ranks(tmp_path, tp, dp, redundant):
    """Under EP the planner's weights per GPU equal the parameters rank 0 of that layout builds."""
    from roofline.attention.torch_backend import TorchAttentionBackend
    from roofline.distributed.layout import ParallelLayout
    from roofline.distributed.parallel_state import parallel_layout_as
    from roofline.model_executor.models.registry import resolve_architecture
    from roofline.planner.cost_model import PlanInputs, expert_parallel_traffic, make_plan, weight_bytes_per_gpu
    from roofline.planner.hardware import get_hardware

    cfg = tiny_config("mixtral")
    cfg.architectures = [resolve_architecture(cfg)[0]]
    cfg.save_pretrained(tmp_path)
    spec = load_model_spec(str(tmp_path))
    layout = ParallelLayout(tp=tp, dp=dp, expert_parallel=True, num_redundant_experts=redundant)
    def rank0_params(layout):
        with parallel_layout_as(layout, 0), torch.device("meta"):
            return sum(x.numel() for x in resolve_architecture(cfg)[1](cfg, TorchAttentionBackend()).parameters())

    p = PlanInputs(spec, get_hardware("h100-sxm"), tp=tp, dp=dp, expert_parallel=True,
                   num_redundant_experts=redundant, weight_dtype="fp32", batch=8)
    p_tp = PlanInputs(spec, get_hardware("h100-sxm"), tp=tp, weight_dtype="fp32")
    # what EP changes per GPU, exactly (the planner also divides the small replicated norms/router by tp,
    # the same under both layouts, so it cancels here)
    assert weight_bytes_per_gpu(p) - weight_bytes_per_gpu(p_tp) == pytest.approx(
        4 * (rank0_params(layout) - rank0_params(ParallelLayout(tp=tp))))
    traffic = expert_parallel_traffic(p)
    ep = tp * dp
    per_layer = 8 * (ep - 1) + (8 / ep) * 2 * (ep - 1) / ep * (8 + 2 * spec.hidden_size * 4)
    assert traffic["all_to_all_bytes_per_step"] == pytest.approx(per_layer * spec.num_moe_layers)
    assert traffic["redundant_expert_bytes_per_gpu"] == pytest.approx(
        spec.num_moe_layers * redundant / ep * spec.expert_params() * 4)
    assert make_plan(p).results["ep_size"] == ep
    with pytest.raises(ValueError, match="8 experts \\+ 1 redundant do not split evenly over 4"):
        PlanInputs(spec, get_hardware("h100-sxm"), tp=2, dp=2, expert_parallel=True, num_redundant_experts=1)


def test_fp8_block_checkpoints_count_one_byte_per_weight_plus_scales():
    """DeepSeek-V3 ships e4m3 weights with an fp32 scale per 128 x 128 block: 1 + 4/16384 bytes a weight."""
    from roofline.planner.cost_model import PlanInputs, weight_bytes_per_gpu
    from roofline.planner.hardware import get_hardware

    spec = load_model_spec("deepseek-v3")
    assert spec.native_dtype == "fp8" and spec.weight_block_elems == 128 * 128
    p = PlanInputs(spec, get_hardware("h100-sxm"), tp=8)
    assert p.weight_bytes == pytest.approx(1 + 4 / 16384)
    assert weight_bytes_per_gpu(p) == pytest.approx(spec.total_params() * (1 + 4 / 16384) / 8)
    bf16 = PlanInputs(spec, get_hardware("h100-sxm"), tp=8, weight_dtype="bf16")
    assert bf16.weight_bytes == 2  # dequantized: no scales


def test_dsa_attention_time_takes_the_rate_of_each_kernel_that_runs():
    """cost_model.attention_time (compute-bound here): a DSA decode past index_topk runs its indexer at the
    indexer's rate and its attention over the kept rows at the sparse decode's; within index_topk it is dense
    MLA at the dense rate; a rate not given is the dense one."""
    from roofline.planner.cost_model import attention_time

    spec = load_model_spec("deepseek-v3.2")
    fast_bw, dense, indexer, sparse = 1e30, 2e10, 8e10, 1e10
    short, long = spec.index_topk // 2, 16 * spec.index_topk
    assert attention_time(spec, short, 4, fast_bw, dense, indexer, sparse) == pytest.approx(
        spec.attention_flops_per_token(short) / dense)
    idx = spec.indexer_flops_per_token(long)
    assert idx > 0
    attn = spec.attention_flops_per_token(long) - idx
    assert attention_time(spec, long, 4, fast_bw, dense, indexer, sparse) == pytest.approx(attn / sparse + idx / indexer)
    assert attention_time(spec, long, 4, fast_bw, dense) == pytest.approx((attn + idx) / dense)
