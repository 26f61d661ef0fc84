"""Routing (roofline/model_executor/layers/moe/router.py) against HF transformers' own router modules:
the same hidden states and gate weight through both, the same experts chosen (ties included: experts
with identical gate rows, all-zero hidden states) and the same weights; DeepSeek-V3's correction bias
steers the choice but not the weights (GLM-4.5 routes as V3); configs we cannot serve fail naming the field."""

from __future__ import annotations

import pytest
import torch

from roofline.model_executor.layers.moe.router import RoutingConfig, routing_from_hf_config, select_experts

E, H = 16, 32


def _hidden(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    x[:3] = 0.0  # every logit 0: a full tie
    return x


def _gate_weight(seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, H, generator=g)
    w[5] = w[2]  # experts 2 and 5 always tie
    w[11] = w[9]
    return w


def _hf_router(kind: str, **cfg):
    from transformers import (DeepseekV2Config, DeepseekV3Config, Glm4MoeConfig, MixtralConfig, Qwen2MoeConfig,
                              Qwen3MoeConfig)
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    table = {
        "mixtral": (MixtralConfig, MixtralTopKRouter, dict(num_local_experts=E)),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeTopKRouter, dict(num_experts=E)),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeTopKRouter, dict(num_experts=E)),
        "deepseek_v2": (DeepseekV2Config, DeepseekV2TopkRouter, dict(n_routed_experts=E)),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3TopkRouter, dict(n_routed_experts=E)),
        "glm4_moe": (Glm4MoeConfig, Glm4MoeTopkRouter, dict(n_routed_experts=E)),
    }
    config_cls, router_cls, experts = table[kind]
    cfg.setdefault("num_experts_per_tok", 2)
    config = config_cls(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, **experts, **cfg)
    router = router_cls(config).eval()
    with torch.no_grad():
        router.weight.copy_(_gate_weight())
    return config, router


CASES = {
    "mixtral_top2": ("mixtral", dict(num_experts_per_tok=2)),
    "qwen2_top4_raw": ("qwen2_moe", dict(num_experts_per_tok=4, norm_topk_prob=False)),
    "qwen3_top4_norm": ("qwen3_moe", dict(num_experts_per_tok=4, norm_topk_prob=True)),
    "dsv2_greedy": ("deepseek_v2", dict(num_experts_per_tok=3, topk_method="greedy", routed_scaling_factor=2.0)),
    "dsv2_group_limited": ("deepseek_v2", dict(num_experts_per_tok=3, topk_method="group_limited_greedy",
                                               n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    "dsv3_noaux_tc": ("deepseek_v3", dict(num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
                                          routed_scaling_factor=2.5)),
    "dsv3_no_renorm": ("deepseek_v3", dict(num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=False,
                                           routed_scaling_factor=1.0)),
    "glm4_moe_grouped": ("glm4_moe", dict(num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
                                          routed_scaling_factor=2.5)),
}


def _assert_same_choice(ours, theirs):
    (w, ids), (hw, hids) = ours, theirs
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == hids.shape
    ids_sorted, perm = ids.sort(dim=-1)
    hids_sorted, hperm = hids.sort(dim=-1)
    assert torch.equal(ids_sorted, hids_sorted)
    torch.testing.assert_close(w.gather(1, perm), hw.float().gather(1, hperm), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", list(CASES))
def test_routing_matches_hf_router(case):
    kind, cfg = CASES[case]
    config, router = _hf_router(kind, **cfg)
    routing = routing_from_hf_config(config)
    x = _hidden()
    bias = None
    if kind in ("deepseek_v3", "glm4_moe"):
        with torch.no_grad():
            router.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, E))
        bias = router.e_score_correction_bias
    with torch.no_grad():
        _, hw, hids = router(x)
        logits = torch.nn.functional.linear(x, router.weight)
    _assert_same_choice(select_experts(logits, routing, bias), (hw, hids))


def test_ties_resolve_as_hf():
    """Rows with every logit equal, and experts with identical gate rows, choose the experts HF does."""
    config, router = _hf_router("mixtral", num_experts_per_tok=3)
    x = _hidden()
    with torch.no_grad():
        _, hw, hids = router(x)
        w, ids = select_experts(torch.nn.functional.linear(x, router.weight), routing_from_hf_config(config))
    tied_rows = (x == 0).all(dim=1)
    assert tied_rows.sum() == 3
    assert torch.equal(ids[tied_rows].sort(-1).values, hids[tied_rows].sort(-1).values)
    both = ((ids == 2).any(1) & (ids == 5).any(1)).sum()
    assert both > 0, "some row chose both tied experts"
    _assert_same_choice((w, ids), (hw, hids))


def test_correction_bias_steers_choice_not_weights():
    """A large bias on expert 7 makes every token choose it, with its unbiased sigmoid score as weight."""
    routing = RoutingConfig(top_k=2, scoring="sigmoid", num_groups=4, topk_groups=2, group_score="top2_sum",
                            renormalize=False)
    logits = torch.randn(10, E, generator=torch.Generator().manual_seed(3))
    bias = torch.zeros(E)
    bias[7] = 10.0
    w, ids = select_experts(logits, routing, bias)
    assert (ids == 7).any(dim=1).all()
    at7 = (ids == 7).float().argmax(dim=1)
    torch.testing.assert_close(w.gather(1, at7[:, None])[:, 0], logits[:, 7].sigmoid())
    w0, ids0 = select_experts(logits, routing)
    assert not (ids0 == 7).any(dim=1).all(), "without the bias expert 7 is not always chosen"


def test_group_limit_keeps_choice_inside_chosen_groups():
    routing = RoutingConfig(top_k=3, num_groups=4, topk_groups=1, group_score="max")
    logits = torch.randn(32, E, generator=torch.Generator().manual_seed(4))
    _, ids = select_experts(logits, routing)
    groups = ids // (E // 4)
    assert (groups == groups[:, :1]).all()
    best_group = logits.softmax(-1).view(32, 4, 4).max(-1).values.argmax(-1)
    assert torch.equal(groups[:, 0], best_group)


@pytest.mark.parametrize("kind,cfg,field", [
    ("deepseek_v2", dict(topk_method="sparse_magic"), "topk_method"),
    ("deepseek_v3", dict(scoring_func="tanh"), "scoring_func"),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=3, topk_group=1), "n_group"),
    ("deepseek_v3", dict(n_group=4, topk_group=5), "topk_group"),
    ("glm4_moe", dict(topk_method="greedy"), "topk_method"),  # HF's GLM router is always V3's
    ("glm4_moe", dict(scoring_func="softmax"), "scoring_func"),
    ("mixtral", dict(num_experts_per_tok=E + 1), "num_experts_per_tok"),
])
def test_unservable_routing_names_the_field(kind, cfg, field):
    config, _ = _hf_router(kind, **{k: v for k, v in cfg.items() if k not in ("topk_method", "scoring_func")})
    for k, v in cfg.items():
        setattr(config, k, v)
    with pytest.raises(ValueError, match=field):
        routing_from_hf_config(config)
