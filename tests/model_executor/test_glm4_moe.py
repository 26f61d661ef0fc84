"""GLM-4.5 (Glm4MoeForCausalLM) against HF transformers on a tiny random checkpoint written by `save_pretrained`
(tests/reference/hf_models.py "glm4_moe": 3 layers, the first dense; 8 experts in 4 groups, top-2 of the
top-2 groups, sigmoid scores with a correction bias, renormalised and scaled; a shared expert; rope on half
of each head; q/k norms and q/k/v biases).  Greedy tokens identical in fp32 on the CPU under the default
engine (prefix hits), a 16-token budget, a pool small enough to preempt (recompute and swap), tp=2 and
expert parallel (EP=2 over TP=2, with EPLB moving experts mid-generation); logprobs close; every block back
in the pool.  The fp32 CPU layer stack steps aside for the MoE layers and runs an all-dense config.  Also:
the MTP layer's tensors in a checkpoint are skipped (and speculative 'mtp' refused), and config fields we
cannot honour fail at start-up naming the field."""

from __future__ import annotations

import json
import os

import pytest
import torch

from roofline import LLM
from roofline.eplb.algorithm import initial_placement
from tests.engine.test_feature_invariance import shared_prefix_prompts
from tests.model_executor.family_parity import (
    assert_greedy_matches_hf,
    GREEDY,
    assert_logprobs_close_to_hf,
    generate,
    tiny_family,
)
from tests.model_executor.test_deepseek import VARIANTS
from tests.reference.hf_models import build_tiny_model, hf_greedy, tiny_config

MOE_LAYERS = 2  # layers 1 and 2 (first_k_dense_replace=1)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(checkpoint, prompts sharing a prefix, HF greedy outputs, HF model)."""
    return tiny_family(tmp_path_factory, "glm4_moe")


def _check_default_model(llm):
    model = llm.llm_engine.executor.worker.model
    inner = model.model
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    assert inner.cpu_stack is None  # MoE layers: the fp32 layer stack steps aside
    assert [type(layer.mlp).__name__ for layer in inner.layers] == ["LlamaMLP", "DeepseekMoE", "DeepseekMoE"]
    attn = inner.layers[0].self_attn
    assert (attn.head_dim, attn.rotary.rotary_dim) == (32, 16)  # partial_rotary_factor 0.5 (in rope_parameters)
    assert attn.q_norm is not None and attn.qkv_proj.bias is not None and attn.o_proj.bias is None


@pytest.mark.parametrize("variant", list(VARIANTS) + ["tp2"])
def test_greedy_matches_hf(glm, variant):
    path, prompts, reference, _ = glm
    args = dict(num_kv_blocks=64, tensor_parallel_size=2) if variant == "tp2" else VARIANTS[variant]
    assert_greedy_matches_hf(path, prompts, reference, variant, args, inspect=_check_default_model)


def test_expert_parallel_with_eplb_matches_hf(glm):
    """EP=2 over TP=2: whole experts per rank exchanged by all_to_all, EPLB (2 redundant replicas)
    rebalancing every 3 steps while generating; greedy tokens stay HF's."""
    path, prompts, reference, _ = glm
    placements = []
    outs, stats = generate(
        path, prompts, num_kv_blocks=64, tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
        eplb_config='{"window_size": 4, "step_interval": 3, "num_redundant_experts": 2}',
        inspect=lambda llm: placements.extend(llm.llm_engine.executor.expert_placements()))
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert stats.parallel_steps >= 6 and stats.eplb_rebalances == stats.parallel_steps // 3
    # per MoE layer: counts, slots, hidden states out, outputs back each step; one weight exchange a rebalance
    assert stats.collectives["ep.all_to_all"][0] == MOE_LAYERS * (4 * stats.parallel_steps + stats.eplb_rebalances)
    first = initial_placement(8, 2, 2)
    assert placements != [[list(first.rank_slots(r))] * MOE_LAYERS for r in range(2)]  # experts moved
    for layer in range(MOE_LAYERS):  # 5 slots per rank, together every expert
        assert all(len(rank[layer]) == 5 for rank in placements)
        assert set(placements[0][layer]) | set(placements[1][layer]) == set(range(8))


def test_logprobs_close_to_hf(glm):
    path, prompts, _, hf = glm
    assert_logprobs_close_to_hf(path, prompts, hf)


def test_mtp_layer_tensors_are_skipped(glm, tmp_path):
    """A checkpoint carrying its MTP layer (model.layers.{num_hidden_layers}.*, as GLM-4.5's do) loads with
    those tensors skipped and generates HF's tokens; speculative method 'mtp' is refused at start-up."""
    from safetensors.torch import load_file, save_file

    path, prompts, reference, hf = glm
    for f in os.listdir(path):
        (tmp_path / f).write_bytes(open(os.path.join(path, f), "rb").read())
    n, hidden, vocab = hf.config.num_hidden_layers, hf.config.hidden_size, hf.config.vocab_size
    last = f"model.layers.{n - 1}."  # the MTP layer: a copy of the last MoE layer, plus its own tensors
    layer = {k.replace(last, f"model.layers.{n}."): v.clone()
             for k, v in load_file(os.path.join(path, "model.safetensors")).items() if k.startswith(last)}
    extra = {"eh_proj.weight": torch.randn(hidden, 2 * hidden), "enorm.weight": torch.ones(hidden),
             "hnorm.weight": torch.ones(hidden), "shared_head.norm.weight": torch.ones(hidden),
             "shared_head.head.weight": torch.randn(vocab, hidden), "embed_tokens.weight": torch.randn(vocab, hidden)}
    layer.update({f"model.layers.{n}.{k}": v for k, v in extra.items()})
    save_file(layer, str(tmp_path / "mtp.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    outs, _ = generate(str(tmp_path), prompts[:2], num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in outs] == reference[:2]
    with pytest.raises(ValueError, match="mtp"):
        LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=8, show_progress=False,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_all_dense_layers_run_on_the_cpu_layer_stack(tmp_path):
    """first_k_dense_replace >= num_hidden_layers: no MoE layer, so the fp32 layer stack takes the model (q/k/v
    biases, q/k norms, rope on half of each head) and gives HF's tokens."""
    from roofline.cpu import ops as cpu_ops

    hf = build_tiny_model("glm4_moe", str(tmp_path), seed=6, first_k_dense_replace=3)
    prompts = shared_prefix_prompts(hf.config.vocab_size, n=2, seed=4)
    stacks = []
    outs, _ = generate(str(tmp_path), prompts, num_kv_blocks=64,
                       inspect=lambda llm: stacks.append(llm.llm_engine.executor.worker.model.model.cpu_stack))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    assert (stacks[0] is not None) == cpu_ops.available()


@pytest.mark.parametrize("field,value,match", [
    ("topk_method", "group_limited_greedy", "topk_method"),  # HF's GLM router reads neither field: refused
    ("scoring_func", "softmax", "scoring_func"),
    ("n_group", 3, "n_group"),  # does not divide the 8 experts
    ("topk_group", 5, "topk_group"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_bad_config_fails_at_start_up_naming_the_field(tmp_path, field, value, match):
    cfg = tiny_config("glm4_moe").to_dict()
    cfg["architectures"] = ["Glm4MoeForCausalLM"]
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=8, show_progress=False)
