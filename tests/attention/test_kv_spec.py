"""The KV-cache spec: shapes and bytes per kind, and the engine's pool holding exactly the tokens that
`roofline plan` predicts for the same model and memory (Llama MHA, GQA, MLA)."""

import json

import pytest
import torch

from roofline.attention import kv_spec
from roofline.planner.cost_model import PlanInputs, make_plan
from roofline.planner.hardware import get_hardware
from roofline.planner.model_specs import ModelSpec
from tests.reference.hf_models import tiny_config


def test_shapes_keep_the_block_index_on_dim_1():
    mha = kv_spec.attention_spec(num_kv_heads=2, head_dim=16)
    mla = kv_spec.mla_spec(kv_lora_rank=32, qk_rope_head_dim=8)
    assert mha.shape(7, 16) == (2, 7, 16, 2, 16)
    assert mla.shape(7, 16) == (1, 7, 16, 1, 40)
    assert mha.bytes_per_token(torch.float32) == 2 * 2 * 16 * 4
    assert mla.bytes_per_token(torch.bfloat16) == 40 * 2
    assert kv_spec.bytes_per_block([mha, mla], 16, torch.float32) == 16 * 4 * (64 + 40)
    with pytest.raises(ValueError, match="kind"):
        kv_spec.KVCacheSpec("sliding", 1, 8)
    with pytest.raises(ValueError, match="different"):
        kv_spec.uniform([mha, mla])


def planned_tokens(hf_config: dict, budget: int, block_size: int) -> int:
    spec = ModelSpec.from_hf_config(hf_config)
    plan = make_plan(PlanInputs(spec, get_hardware("h100"), weight_dtype="fp32", kv_dtype="fp32",
                                kv_budget_bytes=budget, block_size=block_size))
    return plan.results["kv_tokens"]


def engine_tokens(tmp_path, hf_config: dict, budget: int, block_size: int) -> int:
    from roofline.engine.llm import LLM

    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", dtype="float32", kv_cache_memory=budget,
              block_size=block_size, show_progress=False)
    return llm.llm_engine.get_stats().num_total_blocks * block_size


@pytest.mark.parametrize("kind", ["llama-mha", "gqa"])
def test_pool_capacity_equals_the_planner(tmp_path, kind):
    cfg = tiny_config("llama", num_key_value_heads=4 if kind == "llama-mha" else 1).to_dict()
    budget, bs = 3 * 2**20 + 12345, 16
    got = engine_tokens(tmp_path, cfg, budget, bs)
    assert got == planned_tokens(cfg, budget, bs)
    assert got > 0
