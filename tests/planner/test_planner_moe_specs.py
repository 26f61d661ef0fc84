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
